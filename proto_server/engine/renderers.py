"""Which renderer turns a family's conversations into tokens, built from the family's data.

A family names how it is rendered (`ToolSyntax.rendering`); the renderers depend on the
families (a call is written in its family's syntax), so the choice is made here, above both,
and not by the family. Harmony's and mistral-common's renderers are imported only for the
families that use them: openai-harmony takes a third of a second to load, and mistral-common
is the `[model]` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from proto_server.engine.chat_template import ChatTemplateRenderer
from proto_server.engine.families.base import Rendering, ToolSyntax
from proto_server.engine.model_renderer import ModelRenderer


def renderer_for(syntax: ToolSyntax, tokenizer: Any, *, cache_bytes: int) -> ModelRenderer:
    """The renderer of `syntax`'s conversations for the model `tokenizer` was read from:
    harmony's for gpt-oss, which has no chat template; mistral-common's where the model's
    folder holds its `tekken.json`; else the model's chat template."""
    if syntax.rendering is Rendering.HARMONY:
        from proto_server.engine.harmony_renderer import HarmonyRenderer

        return HarmonyRenderer(cache_bytes=cache_bytes)
    folder = getattr(tokenizer, "name_or_path", "")
    if (
        syntax.rendering is Rendering.MISTRAL_COMMON
        and folder
        and (Path(folder) / "tekken.json").is_file()
    ):
        from proto_server.engine.mistral_renderer import MistralRenderer, mistral_tokenizer

        mistral = mistral_tokenizer(Path(folder))
        assert mistral is not None  # the file is there
        return MistralRenderer(mistral, tokenizer, cache_bytes=cache_bytes)
    return ChatTemplateRenderer(tokenizer, cache_bytes=cache_bytes, syntax=syntax)
