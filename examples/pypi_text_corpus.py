"""A text corpus every user gets byte for byte: the source files of pinned PyPI wheels, as a Megatron GPT dataset.

The wheels are named, versioned and digested in ``pypi_text_corpus.json`` (beside this file); pip
downloads exactly those (``--require-hashes``), so the text does not depend on the machine or its
Python. Four steps, each deterministic and each checked against the digests in that manifest:

1. ``fetch``: ``pip download`` the pinned wheels into ``DIR/wheels`` (the network).
2. ``text``: the documents, in manifest order, each wheel's members sorted by name. Kept: ``*.py``,
   ``*.pyi``, ``*.rst``, ``*.md``, ``*.txt`` outside ``*.dist-info/``, valid UTF-8, 256 B to 1 MiB
   after ``\\r\\n`` -> ``\\n``; a file whose text was seen before (same sha256) is dropped. One file in
   ``VALID_EVERY`` (by sha256 of ``wheel/member``) is held out for validation. Written to
   ``DIR/corpus.jsonl.xz`` (one ``{"wheel", "path", "split", "text"}`` per line).
3. ``tokenizer``: byte-level BPE (Hugging Face ``tokenizers``) trained on the training documents,
   ``<|endoftext|>`` as id 0, vocabulary ``VOCAB`` (32768 divides every TP size): ``DIR/tokenizer.json``.
4. ``index``: both splits in Megatron's indexed format with megatron-core's own writer
   (``IndexedDatasetBuilder``: one document per file, the end-of-document token appended, as
   Megatron-LM's ``tools/preprocess_data.py --append-eod`` does): ``DIR/pypi_{train,valid}.{bin,idx}``.
   The held-out split is deduplicated against the training split first (``heldout``): a held-out
   file in a vendored folder, or with ``COPY_FRACTION`` of its long lines (``LONG_LINE`` characters
   or more, stripped) found in training, is dropped (a copy of a trained-on file, e.g. pip's vendored
   pygments); in the rest each long line found in training is dropped. The training split, and so
   the tokenizer, are untouched by this.

``build`` runs what is missing of the four. Train with ``--train-data-path DIR/pypi_train
--valid-data-path DIR/pypi_valid --tokenizer-type NullTokenizer --vocab-size 32768
--null-tokenizer-eod-id 0`` (the data is tokenized already).

    pip install ".[sweep]"                                    # what the steps need (tokenizers pinned)
    python examples/pypi_text_corpus.py build --dir data/pypi_32k
    python examples/pypi_text_corpus.py check --dir data/pypi_32k     # digests only, no building

A finished build can travel without the wheels: ``corpus.jsonl.xz`` + ``tokenizer.json``
rebuild the rest (``index``), or ``pack`` the indexed files into one ``.tar.xz``.
"""

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(HERE, "pypi_text_corpus.json")
EOD = "<|endoftext|>"
EOD_ID = 0
VOCAB = 32768
VALID_EVERY = 40
EXTENSIONS = (".py", ".pyi", ".rst", ".md", ".txt")
MIN_BYTES, MAX_BYTES = 256, 2**20
TRAIN, VALID = "pypi_train", "pypi_valid"
CORPUS, TOKENIZER = "corpus.jsonl.xz", "tokenizer.json"
INDEXED = [name + ext for name in (TRAIN, VALID) for ext in (".bin", ".idx")]
LONG_LINE = 30          # characters (stripped): a line long enough to say a file was copied
COPY_FRACTION = 0.5     # of a held-out file's long lines found in training: the file is a copy
VENDORED = ("/_vendor/", "/vendor/", "/vendored/", "/_vendored/", "/extern/", "/_distutils/")


def load_manifest(path=MANIFEST):
    with open(path) as fh:
        return json.load(fh)


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(out, manifest):
    """pip-download the pinned wheels into ``out/wheels`` (hash-checked); returns their paths."""
    wheels = os.path.join(out, "wheels")
    os.makedirs(wheels, exist_ok=True)
    missing = [w for w in manifest["wheels"] if not os.path.exists(os.path.join(wheels, w["file"]))
               or sha256_file(os.path.join(wheels, w["file"])) != w["sha256"]]
    if missing:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
            for w in missing:
                req.write(f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
               "--python-version", "3.12", "--implementation", "py", "--platform", "any", "-d", wheels, "-r", req.name]
        try:
            subprocess.run(cmd, check=True)
        finally:
            os.unlink(req.name)
    return [os.path.join(wheels, w["file"]) for w in manifest["wheels"]]


def is_validation(key):
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % VALID_EVERY == 0


def _keep(members, source, seen, docs):
    """Append the kept ``(source, name, split, text)`` of ``members`` (``(name, read)`` sorted by name)."""
    for name, read in members:
        if not name.endswith(EXTENSIONS) or ".dist-info/" in name:
            continue
        try:
            text = read().decode("utf-8").replace("\r\n", "\n")
        except UnicodeDecodeError:
            continue
        data = text.encode("utf-8")
        digest = hashlib.sha256(data).digest()
        if not (MIN_BYTES <= len(data) <= MAX_BYTES) or digest in seen:
            continue
        seen.add(digest)
        docs.append((source, name, "valid" if is_validation(f"{source}/{name}") else "train", text))


def documents(wheel_paths):
    """``[(wheel, member, split, text)]``: the kept files of the wheels, in order, duplicates dropped."""
    seen, docs = set(), []
    for path in wheel_paths:
        with zipfile.ZipFile(path) as zf:
            members = sorted((i.filename, lambda i=i: zf.read(i)) for i in zf.infolist() if not i.is_dir())
            _keep(members, os.path.basename(path), seen, docs)
    return docs


def documents_from_dir(root):
    """The same filter over a folder's files (smoke runs: no download); hidden folders left out."""
    members = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d not in ("out", "data", "__pycache__"))
        for f in files:
            path = os.path.join(directory, f)
            members.append((os.path.relpath(path, root), lambda p=path: open(p, "rb").read()))
    seen, docs = set(), []
    _keep(sorted(members, key=lambda m: m[0]), os.path.basename(os.path.abspath(root)), seen, docs)
    return docs


def write_corpus(out, docs):
    """``out/corpus.jsonl.xz``; returns the sha256 of its uncompressed bytes (xz framing aside)."""
    digest = hashlib.sha256()
    with lzma.open(os.path.join(out, CORPUS), "wb", preset=6) as fh:
        for wheel, name, split, text in docs:
            line = (json.dumps({"wheel": wheel, "path": name, "split": split, "text": text}, ensure_ascii=False)
                    + "\n").encode("utf-8")
            digest.update(line)
            fh.write(line)
    return digest.hexdigest()


def read_corpus(out):
    """The corpus as ``(train texts, valid documents {"wheel", "path", "text"})`` and the sha256 of its
    uncompressed lines."""
    digest = hashlib.sha256()
    train, valid = [], []
    with lzma.open(os.path.join(out, CORPUS), "rb") as fh:
        for line in fh:
            digest.update(line)
            doc = json.loads(line)
            if doc["split"] == "valid":
                valid.append(doc)
            else:
                train.append(doc["text"])
    return train, valid, digest.hexdigest()


def _long(line):
    line = line.strip()
    return line if len(line) >= LONG_LINE else None


def heldout(train_texts, valid_docs):
    """The held-out texts deduplicated against ``train_texts`` (see the module's step 4) and what was
    dropped: ``(texts, {"files_vendored", "files_copied", "lines_dropped", "lines_kept"})``."""
    seen = {key for text in train_texts for key in map(_long, text.split("\n")) if key}
    texts, stats = [], {"files_vendored": [], "files_copied": [], "lines_dropped": 0, "lines_kept": 0}
    for doc in valid_docs:
        name = f"{doc['wheel']}/{doc['path']}"
        if any(v in "/" + doc["path"] for v in VENDORED):
            stats["files_vendored"].append(name)
            continue
        lines = doc["text"].split("\n")
        keys = [_long(line) for line in lines]
        long_lines = [k for k in keys if k]
        shared = sum(1 for k in long_lines if k in seen)
        if long_lines and shared >= COPY_FRACTION * len(long_lines):
            stats["files_copied"].append(name)
            continue
        stats["lines_dropped"] += shared
        stats["lines_kept"] += len(long_lines) - shared
        texts.append("\n".join(line for line, k in zip(lines, keys) if not (k and k in seen)))
    return texts, stats


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
                           f"{tokenizer.get_vocab_size()} (asked {vocab_size})")
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


def _check(what, got, expected):
    if expected is None or got == expected:
        return True
    message = f"{what}: sha256 {got}, the manifest says {expected}"
    raise SystemExit(message + " (a different input or library version: install the pinned ones, "
                               "pip install \".[sweep]\", and build again in an empty folder)")


def build(out, manifest=None, log=print, source_dir=None):
    """Run the missing steps into ``out`` and check every file against the manifest's digests;
    returns the build record (also ``out/build.json``). A finished build (the indexed files there)
    is only checked: the text and the tokenizer are not needed again. ``source_dir``: the documents of
    that folder instead of the wheels (smoke runs; no digests to match)."""
    manifest = manifest or load_manifest()
    expected = manifest.get("digests", {}) if source_dir is None else {}
    os.makedirs(out, exist_ok=True)
    previous = _read_json(os.path.join(out, "build.json"))
    record = {"source": source_dir or [f"{w['name']}=={w['version']}" for w in manifest["wheels"]],
              "digests": {}, "matches_manifest": source_dir is None}
    start = time.time()
    finished = all(os.path.exists(os.path.join(out, f)) for f in INDEXED)
    counts = {}
    if not finished:
        if not os.path.exists(os.path.join(out, CORPUS)):
            docs = documents(fetch(out, manifest)) if source_dir is None else documents_from_dir(source_dir)
            write_corpus(out, docs)
            log(f"text: {len(docs)} documents ({time.time() - start:.0f} s)")
        train, valid, record["digests"]["corpus"] = read_corpus(out)
        record["matches_manifest"] &= _check(CORPUS, record["digests"]["corpus"], expected.get("corpus"))
        tokenizer_path = os.path.join(out, TOKENIZER)
        if not os.path.exists(tokenizer_path):
            train_tokenizer(train, manifest["vocab_size"]).save(tokenizer_path)
            log(f"tokenizer trained ({time.time() - start:.0f} s)")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_path)
        valid, record["heldout_dedup"] = heldout(train, valid)
        log(f"held out: {len(valid)} files kept, {len(record['heldout_dedup']['files_copied'])} copies and "
            f"{len(record['heldout_dedup']['files_vendored'])} vendored files dropped, "
            f"{record['heldout_dedup']['lines_dropped']} lines found in training dropped")
        for name, texts in ((TRAIN, train), (VALID, valid)):
            ids = [e.ids for e in tokenizer.encode_batch(texts)]
            counts[name] = {"documents": len(texts), "tokens": write_indexed(os.path.join(out, name), ids,
                                                                            manifest["vocab_size"]),
                            "bytes": sum(len(t.encode("utf-8")) for t in texts)}
        log(f"indexed ({time.time() - start:.0f} s)")
    elif "corpus" in previous.get("digests", {}):
        record["digests"]["corpus"] = previous["digests"]["corpus"]  # as built (the text need not travel)
        record["heldout_dedup"] = previous.get("heldout_dedup")
    for f in [TOKENIZER, *INDEXED]:
        if os.path.exists(os.path.join(out, f)):
            record["digests"][f] = sha256_file(os.path.join(out, f))
            record["matches_manifest"] &= _check(f, record["digests"][f], expected.get(f))
    record["splits"] = counts or previous.get("splits") or split_counts(out)
    record.update(vocab_size=manifest["vocab_size"], eod_id=EOD_ID, build_s=round(time.time() - start, 1),
                  tokenizers=previous.get("tokenizers") if finished else _version("tokenizers"),
                  megatron_core=previous.get("megatron_core") if finished else _version("megatron-core"))
    with open(os.path.join(out, "build.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    return record


def build_from_dir(out, root, vocab_size):
    """A small corpus of ``root``'s own text files (smoke runs), built once into ``out``."""
    manifest = dict(load_manifest(), vocab_size=vocab_size, digests={})
    done = _read_json(os.path.join(out, "build.json"))
    if done.get("source") != root or done.get("vocab_size") != vocab_size:
        shutil.rmtree(out, ignore_errors=True)
    return build(out, manifest, log=lambda m: None, source_dir=root)


def split_counts(out):
    """Documents and tokens of each split, read from the ``.idx`` files (megatron-core's reader)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    counts = {}
    for name in (TRAIN, VALID):
        ds = IndexedDataset(os.path.join(out, name))
        counts[name] = {"documents": len(ds), "tokens": int(ds.sequence_lengths.sum())}
    return counts


def _read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def _version(package):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def check(out, manifest=None):
    """``{file: True/False/None (absent)}``: the build's files against the manifest's digests."""
    manifest = manifest or load_manifest()
    result = {}
    for f, want in manifest.get("digests", {}).items():
        if f == "corpus":
            result[f] = read_corpus(out)[2] == want if os.path.exists(os.path.join(out, CORPUS)) else None
        else:
            path = os.path.join(out, f)
            result[f] = sha256_file(path) == want if os.path.exists(path) else None
    return result


def pack(out, archive):
    """The indexed files, ``build.json`` and the tokenizer in one ``.tar.xz`` (what a GPU machine needs)."""
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        for f in [*INDEXED, "build.json", TOKENIZER]:
            tar.add(os.path.join(out, f), arcname=f)
    return archive


def unpack(archive, out):
    os.makedirs(out, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(out, filter="data")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["build", "check", "pack", "unpack"])
    parser.add_argument("--dir", required=True, help="the build folder")
    parser.add_argument("--archive", help="pack / unpack: the .tar.xz")
    parser.add_argument("--from-dir", default=None, help="build: this folder's text files instead of the wheels "
                                                          "(smoke runs)")
    parser.add_argument("--vocab-size", type=int, default=None, help="with --from-dir (default: the manifest's)")
    args = parser.parse_args(argv)
    if args.step == "build" and args.from_dir:
        print(json.dumps(build_from_dir(args.dir, os.path.abspath(args.from_dir),
                                        args.vocab_size or load_manifest()["vocab_size"]), indent=1))
    elif args.step == "build":
        print(json.dumps(build(args.dir), indent=1))
    elif args.step == "check":
        result = check(args.dir)
        print(json.dumps(result, indent=1))
        return 0 if all(result.values()) else 1
    elif args.step == "pack":
        print(pack(args.dir, args.archive or os.path.join(args.dir, "indexed.tar.xz")))
    else:
        print(unpack(args.archive, args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
