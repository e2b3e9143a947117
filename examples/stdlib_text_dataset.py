"""Real text without a network: the Python standard library's sources as a Megatron GPT dataset.

Every ``*.py`` file of the running interpreter's standard library (``sysconfig``'s ``stdlib``
directory, ``site-packages`` left out) is one document: code, comments, docstrings, and the
reference manual's prose in ``pydoc_data/topics.py``. Text nobody here wrote, present on every
machine with Python, tens of MB (CPython 3.12's: 35 MB in 1700 files; distributions that split
off ``test/`` ship less). The steps:

1. Files are split by a hash of their path: one in ``VALID_EVERY`` is held out for validation.
2. A byte-level BPE tokenizer (Hugging Face ``tokenizers``) is trained on the training files,
   ``<|endoftext|>`` (id 0) first, vocabulary ``--vocab-size`` (32768 divides every TP size).
3. Each split is written in Megatron's indexed format with megatron-core's own writer
   (``IndexedDatasetBuilder``: one document per file, the end-of-document token appended, as
   Megatron-LM's ``tools/preprocess_data.py --append-eod`` does).

Out: ``DIR/tokenizer.json``, ``DIR/stdlib_train.{bin,idx}``, ``DIR/stdlib_valid.{bin,idx}``,
``DIR/manifest.json`` (interpreter, file list digest, token counts, build time). Train on it with
``--train-data-path DIR/stdlib_train --valid-data-path DIR/stdlib_valid --tokenizer-type
NullTokenizer --vocab-size V --null-tokenizer-eod-id 0`` (the data is tokenized already; Megatron
needs only the vocabulary size and the end-of-document id).

    python examples/stdlib_text_dataset.py --out data/stdlib [--vocab-size 32768] [--max-mb 2]
"""

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time

EOD = "<|endoftext|>"
EOD_ID = 0
VALID_EVERY = 20  # one file in 20 (by path hash) is held out
TRAIN, VALID = "stdlib_train", "stdlib_valid"


def stdlib_files(root=None):
    """``[(relative path, text)]`` of the standard library's ``*.py`` files, sorted by path;
    files that are not UTF-8 (a few test inputs) are left out."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                try:
                    with open(path, encoding="utf-8") as fh:
                        text = fh.read()
                except (UnicodeDecodeError, OSError):
                    continue
                if text.strip():
                    found.append((os.path.relpath(path, root), text))
    return sorted(found)


def is_validation(relpath):
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % VALID_EVERY == 0


def train_tokenizer(texts, vocab_size):
    """Byte-level BPE on ``texts``, ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tokenizer.token_to_id(EOD) != EOD_ID or tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer: {EOD} got id {tokenizer.token_to_id(EOD)}, vocabulary "
                           f"{tokenizer.get_vocab_size()} (asked {vocab_size}): too little text for the vocabulary?")
    return tokenizer


def write_indexed(prefix, token_ids, vocab_size):
    """One Megatron indexed dataset (``prefix.bin`` / ``prefix.idx``), a document per list of ids."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for ids in token_ids:
        document = numpy.asarray([*ids, EOD_ID], dtype=dtype)
        builder.add_document(document, [document.size])
    builder.finalize(prefix + ".idx")
    return sum(len(ids) + 1 for ids in token_ids)


def build(out, vocab_size=32768, max_mb=None, root=None):
    """Build the tokenizer and both splits into ``out``; returns the manifest (also written there)."""
    start = time.time()
    files = stdlib_files(root)
    if max_mb is not None:  # a small corpus for smoke runs: the first files by path hash
        files.sort(key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())
        kept, size = [], 0
        for f in files:
            if size > max_mb * 2**20:
                break
            kept.append(f)
            size += len(f[1])
        files = sorted(kept)
    if not files:
        raise SystemExit(f"no *.py files under {root or sysconfig.get_paths()['stdlib']}")
    train = [text for path, text in files if not is_validation(path)]
    valid = [text for path, text in files if is_validation(path)]
    os.makedirs(out, exist_ok=True)
    tokenizer = train_tokenizer(train, vocab_size)
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    counts = {}
    for name, texts in ((TRAIN, train), (VALID, valid)):
        ids = [e.ids for e in tokenizer.encode_batch(texts)]
        counts[name] = {"documents": len(texts), "tokens": write_indexed(os.path.join(out, name), ids, vocab_size),
                        "characters": sum(map(len, texts))}
    digest = hashlib.sha256()
    for path, text in files:
        digest.update(path.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    manifest = {
        "source": "the *.py files of the Python standard library (site-packages left out)",
        "python": sys.version.split()[0], "stdlib": root or sysconfig.get_paths()["stdlib"],
        "files": len(files), "files_sha256": digest.hexdigest(), "max_mb": max_mb,
        "validation": f"files whose sha256(relative path) % {VALID_EVERY} == 0",
        "tokenizer": "byte-level BPE (tokenizers " + __import__("tokenizers").__version__ + ")",
        "vocab_size": vocab_size, "eod_id": EOD_ID, "splits": counts, "build_s": round(time.time() - start, 1),
    }
    with open(os.path.join(out, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    return manifest


def matches(out, vocab_size, max_mb=None):
    """The manifest in ``out`` when a finished build of this size is there, else None."""
    try:
        with open(os.path.join(out, "manifest.json")) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return None
    complete = all(os.path.exists(os.path.join(out, n + ext)) for n in (TRAIN, VALID) for ext in (".bin", ".idx"))
    same = manifest.get("vocab_size") == vocab_size and manifest.get("max_mb") == max_mb
    return manifest if complete and same else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the tokenizer, the two splits and manifest.json")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--max-mb", type=float, default=None, help="use only about this many MB of text (smoke runs)")
    args = parser.parse_args(argv)
    if args.vocab_size < 512:
        parser.error(f"--vocab-size must be at least 512 (the byte alphabet and merges), got {args.vocab_size}")
    manifest = build(args.out, args.vocab_size, args.max_mb)
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
