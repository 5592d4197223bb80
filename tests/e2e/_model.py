"""Build a tiny random-weight Llama and a byte-level BPE tokenizer, offline.

vLLM loads the resulting directory like any Hugging Face model directory. Nothing is
downloaded: the weights come from a seeded ``torch`` generator and the tokenizer is
trained here on a few sentences. The build is deterministic (same arguments, same
bytes of weights and the same tokenizer), so two engines built from two directories
with the same arguments produce the same tokens.

Different arguments (``seed``, ``hidden``, ``layers``, ...) give a *different* model,
which the kvd tests use to check that engines with different fingerprints never share
cached blocks.

This module imports neither kvd nor vLLM; ``torch``, ``transformers`` and
``tokenizers`` are imported lazily by :func:`build_tiny_model`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["CORPUS", "build_tiny_model", "long_prompt", "model_params"]

# The marker is written last; a directory without it is a failed or partial build.
_MARKER = "kvd-tiny-model.json"
# Bumped whenever the build recipe changes, so cached directories are rebuilt.
_RECIPE_VERSION = 1

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A key-value cache keeps the attention keys and values of every token already seen.",
    "Offloading moves blocks of that cache from the accelerator to host memory and back.",
    "One daemon per node owns a shared pool and decides which blocks to evict.",
    "Engines with the same model share blocks; different models never see each other.",
    "Prefix caching hashes each full block of tokens together with the hash of its parent.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in prompts too.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
]


def model_params(
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 256,
    vocab: int = 512,
    max_positions: int = 16384,
    dtype: str = "bfloat16",
) -> dict:
    """The full parameter set of a build (defaults filled in), as stored in the marker."""
    return {
        "recipe": _RECIPE_VERSION,
        "seed": seed,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate": intermediate,
        "vocab": vocab,
        "max_positions": max_positions,
        "dtype": dtype,
    }


def build_tiny_model(path: str | os.PathLike[str], **params) -> Path:
    """Build the model into ``path`` (a directory) unless it already holds this build.

    Keyword arguments are those of :func:`model_params`. If ``path`` holds a complete
    build with the same parameters it is reused as is; a partial build or one with other
    parameters is replaced. The build happens in a sibling temporary directory that is
    renamed into place, so a crash never leaves a half-written model behind.
    Returns ``path`` as a :class:`Path`.
    """
    target = Path(path)
    wanted = model_params(**params)
    if _is_built(target, wanted):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (parallel test runs share the cache directory).
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_built(target, wanted):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _build(staging, wanted)
            (staging / _MARKER).write_text(json.dumps(wanted, sort_keys=True))
            staging.chmod(0o755)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def _is_built(target: Path, wanted: dict) -> bool:
    try:
        return json.loads((target / _MARKER).read_text()) == wanted
    except (OSError, ValueError):
        return False


def long_prompt(approx_words: int, *, variant: int = 0) -> str:
    """A deterministic English-like prompt of about ``approx_words`` words.

    With the tiny tokenizer a word is about 1.25 tokens (500 words ~ 630 tokens). ``variant`` changes the text
    from the very first word, so different variants share no prefix block.
    """
    words = " ".join(CORPUS).replace(",", "").replace(".", "").split()
    out = [f"Document {variant}:"]
    i = variant * 7
    while len(out) < approx_words:
        out.append(words[i % len(words)])
        i += 3 + variant  # stride through the corpus so the text is not one sentence
    return " ".join(out)


def _build(directory: Path, p: dict) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # Tokenizer: byte-level BPE; every byte is in the initial alphabet, so any text
    # encodes (no unknown token).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=p["vocab"],
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=p["max_positions"],
    )
    fast.save_pretrained(directory)
    vocab_size = max(p["vocab"], len(fast))

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p["hidden"],
        intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        head_dim=p["head_dim"],
        max_position_embeddings=p["max_positions"],
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=p["dtype"],
    )
    # Weights from a private generator: independent of the global RNG state and of
    # whatever else the process did before.
    gen = torch.Generator().manual_seed(p["seed"])
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, tensor in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                # RMSNorm weights near 1 keep activations in a sane range.
                tensor.copy_(1.0 + 0.05 * torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=gen))
    model = model.to(getattr(torch, p["dtype"]))
    model.save_pretrained(directory, safe_serialization=True)


if __name__ == "__main__":  # pragma: no cover - developer helper
    import sys

    out = build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else ".e2e-cache/tiny-llama")
    print(out)
