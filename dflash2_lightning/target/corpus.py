"""A small built-in corpus: deterministic, built locally, no network.

It trains the tiny target's tokenizer (so it lives with the target: the tiny target is built from it) and is the
default training data for the tiny config and CI.
Three kinds of samples, in the same record shapes as the jsonl files :mod:`dflash2_lightning.data.datamodule` reads:

- ``{"text": ...}`` paragraphs of documentation of a fixed list of standard-library objects
  (``inspect.getdoc``; the project pins one Python minor version, so the text is stable);
- ``{"text": ...}`` synthetic sentences (counting, arithmetic, lists) from a seeded generator;
- ``{"messages": [...]}`` short synthetic chat conversations with a single clear assistant answer.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import random
from typing import Any

# Objects whose documentation becomes text samples (dotted paths, resolved at build time).
_DOC_OBJECTS = (
    "json.dumps",
    "json.loads",
    "json.JSONDecoder",
    "json.JSONEncoder",
    "os.path.join",
    "os.path.split",
    "os.path.splitext",
    "os.path.normpath",
    "os.walk",
    "os.makedirs",
    "collections.OrderedDict",
    "collections.Counter",
    "collections.deque",
    "collections.namedtuple",
    "collections.defaultdict",
    "collections.ChainMap",
    "itertools.chain",
    "itertools.groupby",
    "itertools.islice",
    "itertools.product",
    "itertools.permutations",
    "itertools.combinations",
    "itertools.accumulate",
    "itertools.zip_longest",
    "functools.reduce",
    "functools.partial",
    "functools.lru_cache",
    "functools.wraps",
    "functools.total_ordering",
    "functools.singledispatch",
    "textwrap.wrap",
    "textwrap.fill",
    "textwrap.dedent",
    "textwrap.indent",
    "textwrap.shorten",
    "string.Template",
    "string.Formatter",
    "string.capwords",
    "re.compile",
    "re.sub",
    "re.split",
    "re.findall",
    "re.escape",
    "re.fullmatch",
    "heapq.heappush",
    "heapq.heappop",
    "heapq.merge",
    "heapq.nlargest",
    "heapq.nsmallest",
    "bisect.bisect_left",
    "bisect.insort",
    "random.Random.shuffle",
    "random.Random.sample",
    "random.Random.choices",
    "random.Random.gauss",
    "statistics.mean",
    "statistics.median",
    "statistics.stdev",
    "statistics.variance",
    "fractions.Fraction",
    "decimal.Decimal.quantize",
    "datetime.timedelta",
    "datetime.date.isoformat",
    "pathlib.Path.glob",
    "pathlib.Path.resolve",
    "pathlib.PurePath.relative_to",
    "pathlib.Path.mkdir",
    "shutil.copytree",
    "shutil.rmtree",
    "shutil.move",
    "tempfile.mkstemp",
    "tempfile.TemporaryDirectory",
    "csv.reader",
    "csv.DictWriter",
    "argparse.ArgumentParser.add_argument",
    "logging.basicConfig",
    "logging.Logger.setLevel",
    "dataclasses.dataclass",
    "dataclasses.field",
    "dataclasses.asdict",
    "contextlib.contextmanager",
    "contextlib.suppress",
    "contextlib.ExitStack",
    "enum.Enum",
    "typing.NamedTuple",
    "abc.ABC",
    "copy.deepcopy",
    "pprint.pformat",
    "base64.b64encode",
    "hashlib.sha256",
    "zlib.compress",
    "difflib.SequenceMatcher",
    "difflib.unified_diff",
    "operator.itemgetter",
    "operator.attrgetter",
    "unicodedata.normalize",
    "uuid.uuid4",
    "threading.Thread",
    "threading.Lock",
    "queue.Queue",
    "subprocess.run",
    "shlex.split",
    "urllib.parse.urlparse",
    "urllib.parse.urlencode",
    "html.escape",
    "sqlite3.connect",
)

_NAMES = ("Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena")
_THINGS = ("apples", "books", "cups", "pens", "stones", "coins", "cards", "shells", "plums", "keys")
_COLOURS = ("red", "blue", "green", "yellow", "black", "white", "purple", "orange")
_ANIMALS = ("cat", "dog", "horse", "owl", "fox", "whale", "bee", "frog", "crow", "goat")
_CAPITALS = (
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
    ("Chile", "Santiago"),
    ("Greece", "Athens"),
    ("India", "New Delhi"),
)
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _resolve(dotted: str) -> Any:
    """Import the longest importable module prefix of ``dotted`` and walk the remaining attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _doc_samples() -> list[dict[str, str]]:
    samples = []
    for dotted in _DOC_OBJECTS:
        try:
            doc = inspect.getdoc(_resolve(dotted))
        except (ImportError, AttributeError):
            continue  # an optional stdlib module missing from this build: skip, stays deterministic per build
        # One sample per paragraph keeps samples short; tiny paragraphs carry too little text.
        for k, para in enumerate((doc or "").split("\n\n")):
            para = para.strip()
            if len(para) >= 40:
                samples.append({"text": f"{dotted}: {para}" if k == 0 else para})
    return samples


def _synthetic_texts(rng: random.Random, n: int) -> list[dict[str, str]]:
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            start = rng.randrange(1, 50)
            out.append({"text": "Counting: " + ", ".join(str(start + k) for k in range(rng.randrange(5, 15))) + "."})
        elif kind == 1:
            a, b = rng.randrange(2, 100), rng.randrange(2, 100)
            out.append({"text": f"{a} plus {b} is {a + b}. {a} times {b} is {a * b}."})
        elif kind == 2:
            who, n_things, thing = rng.choice(_NAMES), rng.randrange(2, 10), rng.choice(_THINGS)
            colour = rng.choice(_COLOURS)
            out.append(
                {
                    "text": f"{who} has {_NUMBER_WORDS[n_things]} {colour} {thing}. "
                    f"{who} gives one away and keeps {_NUMBER_WORDS[n_things - 1]}."
                }
            )
        elif kind == 3:
            country, city = rng.choice(_CAPITALS)
            out.append({"text": f"The capital of {country} is {city}. {city} is a city in {country}."})
        else:
            animals = rng.sample(_ANIMALS, 4)
            out.append({"text": "In alphabetical order: " + ", ".join(sorted(animals)) + "."})
    return out


def _synthetic_chats(rng: random.Random, n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            a, b = rng.randrange(2, 100), rng.randrange(2, 100)
            turns = [("user", f"What is {a} plus {b}?"), ("assistant", f"{a} plus {b} is {a + b}.")]
        elif kind == 1:
            country, city = rng.choice(_CAPITALS)
            turns = [
                ("user", f"What is the capital of {country}?"),
                ("assistant", f"The capital of {country} is {city}."),
            ]
        elif kind == 2:
            word = rng.choice(_ANIMALS + _COLOURS)
            turns = [("user", f"Spell the word {word} backwards."), ("assistant", f"{word} backwards is {word[::-1]}.")]
        elif kind == 3:
            start, count = rng.randrange(1, 30), rng.randrange(3, 8)
            turns = [
                ("system", "You are a concise assistant."),
                ("user", f"Count from {start}, {count} numbers."),
                ("assistant", ", ".join(str(start + k) for k in range(count)) + "."),
            ]
        else:
            items = rng.sample(_THINGS, 3)
            turns = [
                ("user", f"Sort these words: {', '.join(items)}."),
                ("assistant", f"Sorted: {', '.join(sorted(items))}."),
                ("user", "And in reverse?"),
                ("assistant", f"Reversed: {', '.join(sorted(items, reverse=True))}."),
            ]
        out.append({"messages": [{"role": r, "content": c} for r, c in turns]})
    return out


@functools.lru_cache(maxsize=1)
def _builtin_json() -> str:
    rng = random.Random(0)  # random.Random(seed) sequences are stable across Python versions
    records = _doc_samples() + _synthetic_texts(rng, 150) + _synthetic_chats(rng, 150)
    return json.dumps(records)


def builtin_corpus() -> list[dict[str, Any]]:
    """The built-in records (a fresh list each call): text samples and chat conversations."""
    return json.loads(_builtin_json())


def builtin_fingerprint() -> str:
    """sha256 of the built-in corpus content (recorded in offline feature-cache manifests)."""
    return hashlib.sha256(_builtin_json().encode()).hexdigest()


def builtin_texts() -> list[str]:
    """Every string in the built-in corpus (texts and message contents), for tokenizer training."""
    texts = []
    for rec in builtin_corpus():
        if "text" in rec:
            texts.append(rec["text"])
        else:
            texts.extend(m["content"] for m in rec["messages"])
    return texts
