"""A tiny random-weight Llama and a byte-level ChatML tokenizer, built in memory (no download).

The weights are random, so what it says is noise; `Scripted` forces the tokens of a script while
the model still runs every prefill and decode step on its real KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import trio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from proto_server.engine.chunks import (
    Chunk,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallBegin,
    ToolCallEnd,
)
from proto_server.engine.limits import GenerationLimits
from proto_server.engine.local import LocalGenerator, LocalSession
from proto_server.server.listener.app import ProtoServer
from proto_server.server.process.config import ServerConfig
from proto_server.wire.items import FunctionCall, Item, Message, OutputText

from .servers import Running

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer() -> Any:
    """One token per byte, plus ChatML's special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


def tiny_llama(
    seed: int = 0, *, vocab_size: int = 264, eos_token_id: int | None = 258
) -> LlamaForCausalLM:
    """`vocab_size` and `eos_token_id`: another tokenizer's (its embeddings tied, to stay small)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        tie_word_embeddings=vocab_size > 264,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        bos_token_id=257,
        eos_token_id=eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


class Scripted:
    """Teacher forcing: segment after segment, the script's tokens instead of the model's."""

    def __init__(self, tokenizer: Any, segments: Sequence[str]) -> None:
        end = tokenizer.eos_token_id
        self.segments = [[*tokenizer.encode(s, add_special_tokens=False), end] for s in segments]
        self._segment = -1
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        if not generated:
            self._segment += 1
        self.logits.append(logits.clone())
        return self.segments[self._segment][len(generated)]


# -- what the local-model tests share ---------------------------------------------------------

INSTRUCTIONS = "You fix bugs."


USER = Message(role="user", content="the tests fail; fix the bug")


def make(tokenizer: Any, choose: Any, **options: Any) -> LocalGenerator:
    return LocalGenerator(tiny_llama(), tokenizer, threads=1, choose=choose, **options)


NO_LIMITS = GenerationLimits()


async def segment(session: LocalSession, limits: GenerationLimits = NO_LIMITS) -> list[Chunk]:
    send, receive = trio.open_memory_channel[Chunk](1000)
    async with send:
        await session.generate(send, limits)
    return [chunk async for chunk in receive]


def outputs(chunks: Sequence[Chunk]) -> list[Item]:
    """The items a segment's chunks add to the conversation (what the Response machine does)."""
    items: list[Item] = []
    text = ""
    call: list[str] = []
    for chunk in chunks:
        match chunk:
            case TextDelta(text=delta):
                text += delta
            case ToolCallBegin(name=name):
                if text:
                    items.append(Message(role="assistant", content=(OutputText(text=text),)))
                    text = ""
                call = [name, ""]
            case ToolCallArgumentsDelta(delta=delta):
                call[1] += delta
            case ToolCallEnd():
                items.append(
                    FunctionCall(call_id=f"call_{len(items)}", name=call[0], arguments=call[1])
                )
    if text:
        items.append(Message(role="assistant", content=(OutputText(text=text),)))
    return items


async def serve(nursery: trio.Nursery, generator: LocalGenerator) -> Running:
    server = ProtoServer(generator, ServerConfig(port=0))
    address = await nursery.start(server.serve)
    return Running(server, address)
