"""The checkout as a user gets it: a wheel, installed into a fresh venv, its console scripts run outside the checkout.

The wheel must carry what the programs read at run time (the presets, the bundled sample tokenizer and corpus), and
the programs must run from the installed package, not from the checkout. The venv sees this interpreter's
site-packages through a .pth file, for jax and the other dependencies: `venv --system-site-packages` would give the
base interpreter's instead, which a virtualenv running the tests does not install into.
"""

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(cmd, cwd, env, timeout=180):
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} -> {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def _wheel(tmp: Path) -> Path:
    """Builds the wheel from a copy of the working tree's package files, so no build/ of the checkout goes in."""
    src = tmp / "src"
    shutil.copytree(ROOT / "mjax", src / "mjax", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "-w", tmp / "dist", src], cwd=tmp, env=os.environ)
    (wheel,) = (tmp / "dist").glob("mjax-*.whl")
    return wheel


def _venv(tmp: Path, wheel: Path, env) -> tuple[Path, Path]:
    """A fresh venv holding only the wheel; returns its bin directory and its site-packages."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp,
                        env).stdout.strip())
    # Appended after the venv's own site-packages, and its .pth files are not run: the checkout's editable install
    # (if this interpreter has one) stays out.
    (purelib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          "--disable-pip-version-check", "-q", wheel], cwd=tmp, env=env)
    return venv / "bin", purelib


def test_wheel_installs_console_scripts_that_run_from_the_installed_package(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel without network needs setuptools here")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    bin_dir, purelib = _venv(tmp_path, _wheel(tmp_path), env)
    work = tmp_path / "work"  # outside the checkout: no mjax/ or configs/ next to the programs
    work.mkdir()

    where = _run([bin_dir / "python", "-c", "import mjax.cli.train, mjax.data.tokenizer as t, sys; "
                  "print(mjax.cli.train.__file__); print(t.SAMPLE_TOKENIZER); print(*sys.path, sep='\\n')"],
                 work, env).stdout.splitlines()
    assert Path(where[0]).is_relative_to(purelib) and Path(where[1]).is_relative_to(purelib), where
    assert str(ROOT) not in where[2:], where
    for name in ("mjax-train", "mjax-convert", "mjax-generate", "mjax-preprocess"):
        assert str(bin_dir / "python") in (bin_dir / name).read_text()  # the venv's interpreter runs it

    # The tiny preset on the bundled corpus and tokenizer: the wheel's presets and assets, read from site-packages.
    train = _run([bin_dir / "mjax-train", "--config=tiny", "--train_iters=2", "--log_interval=1",
                  "--eval_interval=0", f"--data_cache_path={work / 'cache'}", f"--save={work / 'run'}"], work, env)
    assert "step      2" in train.stderr
    convert = _run([bin_dir / "mjax-convert", "--direction=mjax_to_hf", f"--input={work / 'run'}",
                    f"--output={work / 'hf'}"], work, env)
    assert "converted" in convert.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (work / "hf").iterdir()}
    generate = _run([bin_dir / "mjax-generate", f"--load={work / 'hf'}", "--prompt=Once upon a time",
                     "--max_new_tokens=4"], work, env)
    assert generate.stdout.startswith("ids: [") and "Once upon a time" in generate.stdout
    (work / "in.jsonl").write_text('{"text": "hello world"}\n{"text": "once upon a time"}\n')
    preprocess = _run([bin_dir / "mjax-preprocess", "--input=in.jsonl", "--output_prefix=data/corpus",
                       "--append_eod", "--noprogress"], work, env)
    assert "preprocessed 2 documents" in preprocess.stdout
    assert (work / "data" / "corpus_text_document.idx").is_file()

    # The README's library snippet (the one that builds a model from a preset), run by the installed package.
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
                   if "build_model" in b)
    _run([bin_dir / "python", "-c", snippet + "\nassert logits.shape[:2] == (1, 16)\n"], work, env)

    # --help prints the program's own docstring and flags (absl exits 1 after help).
    help_out = subprocess.run([bin_dir / "mjax-convert", "--help"], cwd=work, env=env, capture_output=True,
                              text=True, timeout=60)
    assert help_out.returncode == 1 and "mjax-convert --direction=hf_to_mjax" in help_out.stdout
    assert "--max_shard_size_mb" in help_out.stdout
