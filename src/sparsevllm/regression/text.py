"""Text sources for the synthetic tasks: haystack filler, needle keys and values.

Everything here ships with Python or is written in this file, so a task set is reproducible
offline from a seed. The natural-text source is the reference documentation CPython bundles in
`pydoc_data.topics` (used by `help()`); it is prose written by people, which is what RULER's essay
filler provides, without a download.
"""

import functools
import random
import re
import string
import uuid

# RULER's "noise" haystack: a fixed cycle of short sentences. A needle stands out in it, so
# retrieval here mostly tests whether the KV method kept the needle's tokens.
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

# Keys are "adjective-noun" pairs; word needles are nouns from a second list so a value never
# repeats a word of its key.
ADJECTIVES = (
    "amber", "ancient", "brave", "bright", "calm", "clever", "crimson", "curious", "dusty",
    "eager", "fancy", "fierce", "gentle", "gilded", "golden", "hidden", "hollow", "humble",
    "icy", "jolly", "lively", "lonely", "lucky", "mellow", "misty", "modest", "narrow", "noble",
    "odd", "pale", "proud", "quiet", "rapid", "rustic", "silent", "silver", "sleepy", "smooth",
    "sturdy", "swift", "tender", "tidy", "vast", "velvet", "vivid", "wandering", "wild", "witty",
)
KEY_NOUNS = (
    "anchor", "badger", "bridge", "canyon", "castle", "cedar", "comet", "compass", "desert",
    "falcon", "feather", "forest", "garden", "glacier", "harbor", "island", "lantern", "meadow",
    "mirror", "monkey", "orchard", "otter", "palace", "pebble", "pepper", "planet", "river",
    "saddle", "shadow", "spider", "summit", "temple", "thunder", "tower", "valley", "violin",
    "walnut", "willow", "window", "wizard",
)
VALUE_WORDS = (
    "apple", "basket", "blanket", "bottle", "button", "candle", "carpet", "carrot", "cherry",
    "cookie", "cotton", "dragon", "engine", "finger", "flower", "guitar", "hammer", "helmet",
    "jacket", "kettle", "kitten", "ladder", "lemon", "magnet", "marble", "muffin", "needle",
    "noodle", "onion", "parrot", "peanut", "pencil", "pillow", "pocket", "potato", "puzzle",
    "rabbit", "ribbon", "rocket", "sandal", "scarf", "squirrel", "teapot", "tiger", "tomato",
    "trumpet", "turtle", "wagon", "whistle", "zebra",
)


@functools.lru_cache(maxsize=1)
def pydoc_text() -> str:
    """The whole bundled Python documentation, topics in a fixed (sorted) order."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name].strip() for name in sorted(topics))


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Sentences of running prose from the Python documentation, in document order.

    Code blocks (indented), grammar rules, headings and tables are dropped so the filler reads
    like an essay; what remains is ~1,400 sentences (~40K tokens), cycled for longer haystacks.
    """
    sentences = []
    for paragraph in pydoc_text().split("\n\n"):
        lines = paragraph.split("\n")
        if any(line.startswith(" ") for line in lines):
            continue  # code, grammar productions, indented tables
        if any(set(line) <= set("*=-+|~^ ") for line in lines):
            continue  # headings and table rules
        flat = " ".join(line.strip() for line in lines)
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat):
            if 40 <= len(sentence) <= 300 and sentence[-1] in ".!?" and ">>>" not in sentence:
                sentences.append(sentence)
    return tuple(sentences)


def filler_sentences(filler: str, count: int, rng: random.Random) -> list[str]:
    """`count` haystack sentences: `noise` repeats the RULER cycle, `essay` reads the documentation
    prose from a random starting sentence onwards (wrapping around)."""
    if filler == "noise":
        return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(count)]
    if filler == "essay":
        pool = prose_sentences()
        start = rng.randrange(len(pool))
        return [pool[(start + i) % len(pool)] for i in range(count)]
    raise ValueError(f"filler must be 'noise' or 'essay', got {filler!r}")


def random_key(rng: random.Random, taken: set[str] = frozenset()) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(KEY_NOUNS)}"
        if key not in taken:
            return key


def random_value(kind: str, rng: random.Random) -> str:
    """A needle value: a 7-digit number, a noun, or a UUID (RULER's three needle types)."""
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return rng.choice(VALUE_WORDS)
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle kind must be 'number', 'word' or 'uuid', got {kind!r}")


def random_variable_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken:
            return name
