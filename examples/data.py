"""A tokenized corpus on disk, read with Grain and packed into the rows of every training step.

    python examples/data.py /tmp/corpus --vocab-size 32        # write the demo corpus
    python examples/train_lm.py --size tiny --data /tmp/corpus  # train on it

**On disk.** A corpus is a directory of ArrayRecord files, one record per document (its token
ids as little-endian int32), and `corpus.json`, which names the files, the vocabulary size
and each document's length (so that every process can plan the batches without reading the
documents). `write_corpus` writes one from the generated sentences of `lm.make_corpus` (nothing
is downloaded); any tokenizer's output can be written the same way.

**The order of examples.** An *example* is one row of `seq_len + 1` tokens. Epoch `e` lays the
documents end to end in the order of a permutation drawn from `(seed, e)` and cuts that stream
into rows, dropping the tail that does not fill one; example `s` of the whole run is row
`s % rows_per_epoch` of epoch `s // rows_per_epoch`. The order is a function of the corpus and
the seed alone, so global batch `k` is examples `[k B, (k + 1) B)` however many processes
read it.

**Each process reads its own rows.** The rows of a global batch that live on a process's
devices (from the batch's `NamedSharding`) are the only ones it reads: it fetches just the
documents those rows cut, with Grain (`grain.MapDataset` over a `grain.sources.
ArrayRecordDataSource`), packs the ragged pieces into rows with `eqpar.ragged.pack_splits`,
and `jax.make_array_from_process_local_data` joins the processes' rows into one global array.

**Exact continuity.** The data position is the number of global batches consumed, which the
training saves in its checkpoint with the model (`train_lm.py --ckpt-dir`). A resume, on the
same or another number of processes, continues with exactly the next examples; the batch size
and seed are saved too, and a resume that changes them is refused.
"""

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import lm

from eqpar.ragged import pack_splits

INDEX = "corpus.json"  # the corpus's description, beside its ArrayRecord files


class DataError(ValueError):
    """A corpus that cannot be read as `--data` says (missing, damaged, or not the one a
    checkpoint was trained on). The message names `--data`, the file and the fix;
    `train_lm.py` prints it as a usage error (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus on disk (see the module docstring).

    - `directory`: where it lives.
    - `files`: its ArrayRecord files, in order (document ids run through them).
    - `vocab_size`: every token id is below it.
    - `lengths`: tokens of each document.
    """

    directory: pathlib.Path
    files: tuple[str, ...]
    vocab_size: int
    lengths: np.ndarray


def write_corpus(
    directory: pathlib.Path | str,
    *,
    num_documents: int = 2_000,
    vocab_size: int = 32,
    num_files: int = 2,
    seed: int = 0,
) -> Corpus:
    """Write a corpus of `num_documents` generated documents (1 to 4 sentences of
    `lm.make_corpus`'s grammar each, token ids as `lm.encode` makes them) into `directory`.

    **Arguments:**

    - `directory`: created if missing; an existing corpus there is replaced.
    - `num_documents`, `vocab_size`: how many documents, and the vocabulary size.
    - `num_files`: ArrayRecord files to spread the documents over (contiguous runs).
    - `seed`: the draw of the sentences.

    **Returns:** the `Corpus` written.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sentences = lm.make_corpus(60 * num_documents, seed=seed).split(". ")
    documents, at = [], 0
    for _ in range(num_documents):
        count = int(rng.integers(1, 5))
        text = ". ".join(sentences[at : at + count]) + "."
        at = (at + count) % max(len(sentences) - 5, 1)
        documents.append(lm.encode(text, vocab_size))
    files = [f"documents-{i:05d}-of-{num_files:05d}.array_record" for i in range(num_files)]
    bounds = np.linspace(0, num_documents, num_files + 1).astype(int)
    for name, begin, end in zip(files, bounds[:-1], bounds[1:]):
        writer = ArrayRecordWriter(str(directory / name), "group_size:1")
        for tokens in documents[begin:end]:
            writer.write(tokens.astype("<i4").tobytes())
        writer.close()
    lengths = [len(tokens) for tokens in documents]
    index = {"files": files, "vocab_size": vocab_size, "lengths": lengths}
    (directory / INDEX).write_text(json.dumps(index))
    return open_corpus(directory)


def open_corpus(directory: pathlib.Path | str) -> Corpus:
    """The corpus in `directory` (written by `write_corpus`); a `DataError` that says how to
    write one when there is none, or which file is wrong."""
    directory = pathlib.Path(directory)
    try:
        index = json.loads((directory / INDEX).read_text())
    except FileNotFoundError:
        raise DataError(
            f"--data {directory}: no corpus there ({INDEX} is missing); write the demo corpus "
            f"with `python examples/data.py {directory} --vocab-size V` first."
        ) from None
    except (OSError, ValueError) as error:
        raise DataError(
            f"--data {directory}: cannot read {directory / INDEX} ({error}); write the corpus "
            "again (python examples/data.py DIR --vocab-size V)."
        ) from None
    try:
        return Corpus(
            directory,
            tuple(str(name) for name in index["files"]),
            int(index["vocab_size"]),
            np.asarray(index["lengths"], dtype=np.int64),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise DataError(
            f"--data {directory}: {directory / INDEX} is not a corpus description (expected "
            f'an object with "files", "vocab_size" and "lengths"; {type(error).__name__}: '
            f"{error}); write the corpus again (python examples/data.py DIR --vocab-size V)."
        ) from None


class RowSource(Protocol):
    """What `place_rows` reads: rows `rows` of the global batch at `position`."""

    batch_size: int

    def rows(self, position: int, rows: range) -> np.ndarray: ...


class PackedCorpus:
    """The examples of a `Corpus` in the order of `seed` (see the module docstring), read
    with Grain and packed into rows of `seq_len + 1` tokens.

    **Arguments:**

    - `corpus`: what to read.
    - `batch_size`: rows of each global batch.
    - `seq_len`: the model's sequence length (a row holds `seq_len + 1` tokens: inputs and
      the targets one to the right).
    - `seed`: the order of the documents in each epoch.
    """

    def __init__(self, corpus: Corpus, *, batch_size: int, seq_len: int, seed: int = 0):
        import grain

        self.corpus, self.batch_size, self.seed = corpus, batch_size, seed
        self.width = seq_len + 1
        self.rows_per_epoch = int(corpus.lengths.sum()) // self.width
        if self.rows_per_epoch < batch_size:
            raise DataError(
                f"--data {corpus.directory}: its {int(corpus.lengths.sum())} tokens make "
                f"{self.rows_per_epoch} rows of {self.width} tokens, fewer than one batch of "
                f"--batch-size {batch_size}: write a larger corpus or use a smaller batch."
            )
        paths = [str(corpus.directory / name) for name in corpus.files]
        # Each file opened alone first, so that a damaged one is named (ArrayRecord's own
        # error can be an empty `RuntimeError`), and its documents counted.
        counts = [len(_open_shard(grain, corpus, path)) for path in paths]
        if sum(counts) != len(corpus.lengths):
            raise DataError(
                f"--data {corpus.directory}: its files hold {sum(counts)} documents "
                f"({', '.join(f'{name}: {n}' for name, n in zip(corpus.files, counts))}) but "
                f"{INDEX} lists {len(corpus.lengths)}; the files do not belong to this "
                f"{INDEX}: write the corpus again (python examples/data.py DIR --vocab-size V)."
            )
        self._file_ends = np.cumsum(counts)  # document ids run through the files in order
        source = grain.sources.ArrayRecordDataSource(paths)
        self.documents = grain.MapDataset.source(source).map(
            lambda record: np.frombuffer(record, dtype="<i4")
        )
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.last_pieces: list[list[list[int]]] = []  # see `rows`

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch `epoch`'s document order and where each document starts in its stream."""
        if epoch not in self._epochs:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.corpus.lengths))
            starts = np.concatenate([[0], np.cumsum(self.corpus.lengths[order])])
            self._epochs = {epoch: (order, starts)}  # one epoch at a time is enough
        return self._epochs[epoch]

    def _document(self, document: int) -> np.ndarray:
        """The tokens of `document`, read with Grain; a `DataError` naming its file when
        that cannot be read or does not hold what `corpus.json` says."""
        file = self.corpus.files[int(np.searchsorted(self._file_ends, document, side="right"))]
        try:
            tokens = self.documents[document]
        except Exception as error:
            raise DataError(
                f"--data {self.corpus.directory}: cannot read document {document} from "
                f"{self.corpus.directory / file} ({type(error).__name__}: {error}); the file is "
                f"damaged or truncated: write the corpus again (python examples/data.py DIR "
                f"--vocab-size V)."
            ) from None
        if len(tokens) != self.corpus.lengths[document]:
            raise DataError(
                f"--data {self.corpus.directory}: document {document} in "
                f"{self.corpus.directory / file} has {len(tokens)} tokens, {INDEX} says "
                f"{self.corpus.lengths[document]}: write the corpus again."
            )
        return tokens

    def example_ids(self, position: int, rows: range) -> list[int]:
        """The ids (places in the run's order of examples) of rows `rows` at `position`."""
        first = position * self.batch_size
        return [first + row for row in rows]

    def rows(self, position: int, rows: range) -> np.ndarray:
        """Rows `rows` of global batch `position`, `[len(rows), seq_len + 1]` int32.

        The documents the rows cut are read with Grain, and their pieces (a ragged batch:
        each piece a run of one document's tokens) packed one row per split by
        `eqpar.ragged.pack_splits`. `last_pieces` keeps each row's pieces as
        `[document, first token, end token]` triples, for logs and tests."""
        tokens, offsets, splits, self.last_pieces = [], [0], [0], []
        for example in self.example_ids(position, rows):
            epoch, row = divmod(example, self.rows_per_epoch)
            order, starts = self._epoch(epoch)
            begin, end = row * self.width, (row + 1) * self.width
            first = int(np.searchsorted(starts, begin, side="right")) - 1
            last = int(np.searchsorted(starts, end, side="left"))
            pieces = []
            for place in range(first, last):
                document = int(order[place])
                lo = max(begin, int(starts[place])) - int(starts[place])
                hi = min(end, int(starts[place + 1])) - int(starts[place])
                tokens.append(self._document(document)[lo:hi])
                offsets.append(offsets[-1] + hi - lo)
                pieces.append([document, lo, hi])
            splits.append(splits[-1] + len(pieces))
            self.last_pieces.append(pieces)
        packed = pack_splits(np.concatenate(tokens), offsets, splits, capacity=self.width)
        return np.asarray(packed.tokens, dtype=np.int32)


def _open_shard(grain: Any, corpus: Corpus, path: str) -> Any:
    """`path`'s `grain.sources.ArrayRecordDataSource`, or a `DataError` naming it."""
    try:
        return grain.sources.ArrayRecordDataSource([path])
    except Exception as error:
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise DataError(
            f"--data {corpus.directory}: cannot open {path} ({why}); the file is missing, "
            f"unreadable, truncated or damaged: write the corpus again (python examples/data.py "
            f"DIR --vocab-size V), or restore the file."
        ) from None


class SyntheticRows:
    """`lm.Batches` (the generated text of the example without `--data`) as a `RowSource`."""

    def __init__(self, batches: lm.Batches):
        self.batches, self.batch_size = batches, batches.batch_size

    def rows(self, position: int, rows: range) -> np.ndarray:
        return self.batches.batch(position)[rows.start : rows.stop]


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> range:
    """The rows of a global array of `shape` split by `sharding` that this process's devices
    hold: a contiguous range (every process's, in one process all of them).

    **Raises:** `DataError` when they are not contiguous, which no mesh of the example gives
    whose data axis follows the processes (data first in `--mesh`)."""
    held = sorted(
        {
            row
            for index in sharding.addressable_devices_indices_map(shape).values()
            for row in range(*index[0].indices(shape[0]))
        }
    )
    if held != list(range(held[0], held[-1] + 1)):
        raise DataError(
            f"--mesh: process {jax.process_index()}'s devices hold rows {held} of each batch, "
            f"not one contiguous block; put the data axis first in --mesh so that it follows "
            f"the processes."
        )
    return range(held[0], held[-1] + 1)


def place_rows(source: RowSource, position: int, sharding: NamedSharding, width: int) -> jax.Array:
    """The global batch at `position` (`[batch_size, width]`, split by `sharding`), to which
    this process contributes only the rows on its own devices, read from `source`."""
    shape = (source.batch_size, width)
    local = source.rows(position, process_rows(sharding, shape))
    return jax.make_array_from_process_local_data(sharding, local, shape)


def checkpoint_state(source: RowSource | None) -> dict[str, Any]:
    """What a checkpoint keeps of a `PackedCorpus` beside the position (the step): the batch
    size, seed and rows per epoch that fix the order of examples (`{}` for other sources)."""
    if not isinstance(source, PackedCorpus):
        return {}
    return {
        "data": {
            "batch_size": source.batch_size,
            "seed": source.seed,
            "rows_per_epoch": source.rows_per_epoch,
        }
    }


def check_restored(state: dict[str, Any], source: RowSource | None) -> None:
    """Refuse a resume whose data would not continue the saved order of examples."""
    if not isinstance(source, PackedCorpus):
        return
    saved = {name: int(value) for name, value in state["data"].items()}
    now = checkpoint_state(source)["data"]
    changed = [f"{name} {saved[name]} -> {now[name]}" for name in now if saved[name] != now[name]]
    if changed:
        raise DataError(
            f"--resume: the checkpoint's data order was made with other settings "
            f"({', '.join(changed)}); the next examples would not follow the ones it trained "
            f"on: resume with the saved --batch-size, --seed and --data."
        )


class ExampleLog:
    """Appends one JSON line per step to `directory/process<P>.jsonl`: the step, its loss, and
    the ids and document pieces of the rows this process read (`PackedCorpus`)."""

    def __init__(self, directory: pathlib.Path | str):
        self.path = pathlib.Path(directory) / f"process{jax.process_index()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(
        self, step: int, loss: float, source: RowSource, sharding: NamedSharding, width: int
    ) -> None:
        """Log step `step` (its batch at position `step - 1`, read as `place_rows` did)."""
        rows = process_rows(sharding, (source.batch_size, width))
        line: dict[str, Any] = {"step": step, "loss": loss, "process": jax.process_index()}
        line["rows"] = [rows.start, rows.stop]
        if isinstance(source, PackedCorpus):
            line["examples"] = source.example_ids(step - 1, rows)
            line["pieces"] = source.last_pieces
        with self.path.open("a") as file:
            file.write(json.dumps(line) + "\n")


def main(argv: Sequence[str] | None = None) -> Corpus:
    """Write the demo corpus (`python examples/data.py DIR`)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=pathlib.Path, help="where to write the corpus")
    parser.add_argument("--documents", type=int, default=2_000, help="number of documents")
    parser.add_argument(
        "--vocab-size", type=int, default=32, help="the model's vocabulary (tiny: 32, small: 64)"
    )
    parser.add_argument("--files", type=int, default=2, help="ArrayRecord files")
    parser.add_argument("--seed", type=int, default=0, help="the draw of the sentences")
    args = parser.parse_args(argv)
    corpus = write_corpus(
        args.directory,
        num_documents=args.documents,
        vocab_size=args.vocab_size,
        num_files=args.files,
        seed=args.seed,
    )
    print(
        f"wrote {len(corpus.lengths)} documents ({int(corpus.lengths.sum())} tokens, vocabulary "
        f"{corpus.vocab_size}) in {len(corpus.files)} ArrayRecord files to {corpus.directory}"
    )
    return corpus


if __name__ == "__main__":
    main()
