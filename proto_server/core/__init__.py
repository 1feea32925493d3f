"""Sans-IO state: the Response state machine, the Conversation, ids, sequence numbers, usage.

Nothing here awaits or reads a clock; the server feeds it events and sends what it returns.
"""
