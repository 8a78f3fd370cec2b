"""Demo model: builds the tiny random-weight Llama that the demo vLLM fleet serves (no hub download).

The model is a stand-in with the shapes vLLM's CPU backend accepts (head_dim 64, float32); its output is
noise, but its prompts are tokenized, cached in 32-token blocks and evicted exactly like a real model's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

# Bump when the code below changes what gets built: a model dir with another recipe is rebuilt (so is one
# built with another chat template: the marker carries the template's hash too).
RECIPE_VERSION = "1"
MARKER_FILE = ".kvscope-model-complete"
CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

VOCAB_SIZE = 2000
SPECIAL_TOKENS = [
    "<s>",
    "</s>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|tools|>",
    "<|tool_call|>",
    "<|documents|>",
    "<|doc|>",
    "<|end|>",
]
# Corpus for the tokenizer: the first ~4 MB of the Python stdlib's .py files in sorted path order.
CORPUS_BYTES = 4_000_000


def default_model_dir() -> Path:
    """Where the demo model lives: `$KVSCOPE_DEMO_MODEL_DIR` (the setting ``demo_model_dir``, kvscope/config.py),
    else `~/.cache/kvscope/tiny-llama`."""
    env = os.environ.get("KVSCOPE_DEMO_MODEL_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvscope" / "tiny-llama"


def recipe_id() -> str:
    """`<RECIPE_VERSION>-<sha256 of the chat template, 12 hex>`: what the completion marker holds."""
    return f"{RECIPE_VERSION}-{hashlib.sha256(CHAT_TEMPLATE_PATH.read_bytes()).hexdigest()[:12]}"


def is_built(dest: Path) -> bool:
    """True when `dest` holds a complete model built by this recipe and chat template."""
    marker = dest / MARKER_FILE
    return marker.is_file() and marker.read_text().strip() == recipe_id()


def build_tiny_model(dest: Path | None = None) -> Path:
    """Build the tiny model into `dest` (default `default_model_dir()`) unless already built; return `dest`.

    Writes `config.json`, `generation_config.json`, `model.safetensors` (LlamaForCausalLM: 2 layers,
    hidden 128, 2 heads of dim 64, 1 KV head, intermediate 256, 4,096 positions, float32, seeded random
    weights), `tokenizer.json` (byte-level BPE, vocab 2,000, trained on the stdlib), `tokenizer_config.json`
    and the chat template. Built in a sibling temp dir and renamed into place, so a crash never leaves a
    half-built model at `dest`. Takes ~10 s. Needs torch and transformers (the `vllm` extra).
    """
    dest = Path(dest) if dest is not None else default_model_dir()
    if is_built(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
    try:
        _build_into(tmp)
        (tmp / MARKER_FILE).write_text(recipe_id() + "\n")
        if dest.exists():
            if is_built(dest):  # another process finished first
                return dest
            shutil.rmtree(dest)  # stale or older recipe
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_built(dest):  # lost a rename race to a concurrent builder: its model is as good as ours
            return dest
        raise
    return dest


def _corpus_files(limit_bytes: int = CORPUS_BYTES) -> list[Path]:
    """Stdlib .py files in sorted order until `limit_bytes` (sorted: the tokenizer must be reproducible)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        files.append(path)
        total += size
        if total >= limit_bytes:
            break
    return files


def _iter_corpus(files: list[Path]):
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer():
    """Train the byte-level BPE tokenizer (a `tokenizers.Tokenizer`) on the stdlib corpus, in ~5 s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_iter_corpus(_corpus_files()), trainer=trainer)
    return tokenizer


def _build_into(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE_PATH.read_text()
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention rejects 16
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
