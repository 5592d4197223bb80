"""A stamp of the model's weights on disk, for the tenant fingerprint.

vLLM keys blocks by token hashes, and the fingerprint names the model by the name or
path vLLM was given. A model updated in place (new weights at the same path, or a hub
model re-downloaded at a new revision) would then find the old weights' KV in kvd after
an engine restart, and serve it. The stamp tells the two apart: a hash of the model
directory's configuration files whole and of samples of its weight files (their sizes
and a few KiB at evenly spaced offsets; a GGUF model is its one file). It is cheap
(reads at most a few MiB, from the page cache the model load just filled) and the same
on every node holding the same files, so engines of a fleet still share through the
remote tier.

It is a sample, not a checksum: weights that differ only outside the sampled bytes
(a fine-tune of a few small tensors) get the same stamp. Set ``kvd_model_version`` to
name the weights yourself (any string; "" turns the stamp off).
"""

from __future__ import annotations

import hashlib
import logging
import os

log = logging.getLogger("vllm.kvd_client")

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 16  # per weight file
SAMPLE_BYTES = 4096
MAX_FILES = 512  # a bound on the work, not a limit on the model


def model_dir(model: str, revision: str | None = None,
              download_dir: str | None = None) -> str | None:
    """Where the weights of ``model`` are: the path itself, or the local copy of a hub
    model (in vLLM's ``download_dir`` when it has one; never downloads; None when there
    is none)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - optional

        return snapshot_download(model, revision=revision, local_files_only=True,
                                 cache_dir=download_dir or None)
    except Exception:  # noqa: BLE001 - not a hub model here: no stamp, not an error
        return None


def weights_stamp(model: str, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """16 hex digits naming the weights of ``model`` (see the module docstring); "" when
    its files are not found."""
    h = hashlib.sha256(f"revision={revision or ''}\0".encode())
    if os.path.isfile(model):  # one file holds it all (GGUF)
        path, names, weights = os.path.dirname(model), [], [os.path.basename(model)]
    else:
        found = model_dir(model, revision, download_dir)
        if found is None:
            return h.hexdigest()[:16] if revision else ""
        path = found
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            log.warning("kvd: cannot list the model directory %s (%s): no weights stamp",
                        path, e)
            return ""
        weights = [n for n in names if n.endswith(WEIGHT_SUFFIXES)][:MAX_FILES]
    for name in [n for n in CONFIG_FILES if n in names] + weights:
        try:
            with open(os.path.join(path, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(f"{name}\0{size}\0".encode())
                if name in CONFIG_FILES:
                    h.update(f.read(1 << 20))
                    continue
                step = max(1, size // SAMPLES)
                for i in range(SAMPLES):
                    f.seek(min(i * step, max(0, size - SAMPLE_BYTES)))
                    h.update(f.read(SAMPLE_BYTES))
        except OSError as e:
            log.warning("kvd: cannot read %s of the model (%s): no weights stamp", name, e)
            return ""
    return h.hexdigest()[:16]
