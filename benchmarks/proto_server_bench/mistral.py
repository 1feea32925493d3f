"""Mistral's tokenizers for `bench families` and the tests, and vLLM's rendering with them.

mistral-common ships one Tekken vocabulary (Mistral Nemo's), at tokenizer version 3; Mistral's
models since use the same kind of file at versions 7 to 13, which differ in where the system
prompt, the tools and the calls go, not in the vocabulary. `mistral_folder` writes that file at
the version asked, so Mistral's framings are measured and tested without a download.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Mistral's tokenizer as mistral-common ships it (Mistral Nemo's Tekken vocabulary).
SHIPPED_TEKKEN = "tekken_240911.json"
#: Where Mistral's files from version 11 on put the special tokens the older list lacks.
LATER_SPECIALS = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}


def mistral_folder(root: Path, version: str, *, tokenizer_json: bool = True) -> Path:
    """A model folder holding mistral-common's shipped Tekken file written at tokenizer
    `version` (which changes where messages, tools and calls go, not the vocabulary), the
    tokenizer.json transformers converts from it (as Mistral's folders ship both) and a
    config: Mistral's tokenizers at the versions its models use, without a download."""
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from transformers.integrations.mistral import (  # type: ignore[attr-defined]
        convert_tekken_tokenizer,
    )

    data = json.loads((Path(mistral_common.__file__).parent / "data" / SHIPPED_TEKKEN).read_text())
    data["config"] = {**data["config"], "version": version}
    if version in ("v11", "v13"):  # from version 11 on, the file lists its special tokens
        specials = [
            {"rank": t["rank"], "token_str": str(t["token_str"]), "is_control": True}
            for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS
        ]
        specials += [
            {"rank": r, "token_str": LATER_SPECIALS.get(r, f"<SPECIAL_{r}>"), "is_control": True}
            for r in range(len(specials), data["config"]["default_num_special_tokens"])
        ]
        data["special_tokens"] = specials
    folder = root / f"mistral-{version}"
    folder.mkdir()
    (folder / "tekken.json").write_text(json.dumps(data))
    (folder / "config.json").write_text('{"model_type": "mistral"}')
    if tokenizer_json:
        convert_tekken_tokenizer(str(folder / "tekken.json")).save_pretrained(folder)
    return folder


def mistral_prompt(
    directory: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[int]:
    """A conversation as vLLM renders it for a Mistral model (`--tokenizer-mode mistral`):
    mistral-common's whole-conversation rendering of the chat `messages` (as vLLM's chat
    endpoint hands them on), call ids cut to the nine characters Mistral's format takes, as
    proto-server cuts them."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from proto_server.engine.mistral_renderer import TEKKEN, mistral_call_id

    for message in messages:
        for call in message.get("tool_calls", ()):
            call["id"] = mistral_call_id(call["id"])
        if "tool_call_id" in message:
            message["tool_call_id"] = mistral_call_id(message["tool_call_id"])
    mistral = MistralTokenizer.from_file(str(directory / TEKKEN), mode=ValidationMode.test)
    request = ChatCompletionRequest.from_openai(messages, tools=tools)
    return list(mistral.encode_chat_completion(request).tokens)
