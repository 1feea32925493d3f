from proto_server.cli import main

raise SystemExit(main())
