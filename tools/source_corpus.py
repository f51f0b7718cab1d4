"""A JSONL corpus (one {"text": ...} document per file) from the text files under some directories, by default this
Python's standard library and installed packages: tens of MB of real text on any machine, for runs longer than the
bundled sample corpus (0.35M tokens) can feed without repeating it. Tokenize the output with scripts/preprocess_data.py.

  python -m tools.source_corpus --out=/tmp/code.jsonl
  python scripts/preprocess_data.py --input=/tmp/code.jsonl --output_prefix=/tmp/code --append_eod --workers=8
  python scripts/train.py ... --data_path=/tmp/code_text_document

Files are taken in sorted path order (the same corpus for the same tree); files that are not UTF-8 are skipped.
"""

import json
import logging
import sys
import sysconfig
from pathlib import Path

from absl import app, flags

from mjax.logging_setup import setup_logging

_PATHS = sysconfig.get_paths()
flags.DEFINE_list("roots", list(dict.fromkeys(_PATHS[k] for k in ("stdlib", "purelib", "platlib"))),
                  "Directories to collect (default: the standard library and site-packages).")
flags.DEFINE_list("patterns", ["*.py"], "File name patterns, searched recursively.")
flags.DEFINE_string("out", None, "JSONL file to write.")
flags.mark_flag_as_required("out")
FLAGS = flags.FLAGS
log = logging.getLogger("mjax")


def collect(roots: list[Path], patterns: list[str]) -> list[Path]:
    """Matching files under any root, each once (site-packages may lie inside the standard library's directory)."""
    return sorted({p.resolve() for root in roots for pat in patterns for p in root.rglob(pat) if p.is_file()})


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    setup_logging()
    roots = [Path(r) for r in FLAGS.roots]
    missing = [str(r) for r in roots if not r.is_dir()]
    if missing:
        log.error("--roots: not a directory: %s", ", ".join(missing))
        return 2
    files = collect(roots, FLAGS.patterns)
    if not files:
        log.error("no files match --patterns=%s under --roots=%s", ",".join(FLAGS.patterns), ",".join(FLAGS.roots))
        return 2
    docs = skipped = chars = 0
    with open(FLAGS.out, "w", encoding="utf-8") as out:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                skipped += 1
                continue
            if text.strip():
                out.write(json.dumps({"text": text}) + "\n")
                docs, chars = docs + 1, chars + len(text)
    log.info("%d documents, %.1f M characters from %s (%d unreadable or not UTF-8 skipped) -> %s",
             docs, chars / 1e6, ", ".join(FLAGS.roots), skipped, FLAGS.out)
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
