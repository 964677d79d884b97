"""A deterministic generator of TinyStories-style stories: the sample corpus for the demo and the
tests, with no download.

Each story is built from a cast (a child or an animal with a name, a trait and a pronoun), a
place, a treasured object, and one of several plots (lost and found, sharing, a fear overcome,
helping a friend, building something, a rainy day, a trip, a birthday, a quarrel made up), with
short dialogue lines and a moral. Everything is drawn from ``random.Random(seed)``, so the same
seed gives the same text on every machine and Python version (``Random`` with an int seed and
``choice``/``randrange``/``shuffle`` are stable across CPython versions).

``sample_corpus()`` gives about 580 KB of training text and 58 KB of validation text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

CORPUS_VERSION = 1  # bump when the generator's output changes: it is part of the token cache key
EOT = "<|endoftext|>"

GIRLS = ["Lily", "Mia", "Sara", "Emma", "Anna", "Zoe", "Lucy", "Ella", "Ruby", "Amy", "Sue", "Kim"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Joe", "Bob", "Dan"]
ANIMALS = [
    ("dog", "Spot"),
    ("cat", "Kitty"),
    ("bird", "Pip"),
    ("bunny", "Hop"),
    ("bear", "Bobo"),
    ("duck", "Quack"),
    ("frog", "Fred"),
    ("mouse", "Squeak"),
    ("fox", "Red"),
    ("puppy", "Buddy"),
]
TRAITS = ["kind", "curious", "brave", "shy", "happy", "silly", "clever", "little", "gentle", "playful"]
PLACES = [
    ("park", "the big park"),
    ("garden", "the sunny garden"),
    ("forest", "the green forest"),
    ("beach", "the sandy beach"),
    ("farm", "the old farm"),
    ("town", "the small town"),
    ("lake", "the blue lake"),
    ("hill", "the tall hill"),
    ("yard", "the back yard"),
    ("meadow", "the quiet meadow"),
]
OBJECTS = [
    "ball",
    "kite",
    "red hat",
    "toy car",
    "book",
    "shiny stone",
    "blue balloon",
    "teddy bear",
    "little boat",
    "yellow flower",
    "drum",
    "box of crayons",
    "sock",
    "toy train",
    "cookie",
]
FEELINGS_GOOD = ["happy", "glad", "proud", "excited", "calm", "joyful"]
FEELINGS_BAD = ["sad", "scared", "worried", "upset", "grumpy", "lonely"]
WEATHER = ["sunny", "windy", "cloudy", "warm", "cold", "bright"]
FOODS = ["apples", "cake", "soup", "bread and jam", "cookies", "a big pie", "carrots", "ice cream"]
VERBS_PLAY = ["play", "run", "jump", "sing", "dance", "explore", "look for bugs", "build a fort"]


@dataclass(frozen=True)
class Character:
    name: str
    kind: str  # "girl", "boy" or an animal
    trait: str
    subj: str  # she / he (a named pet reads better as he/she than "it")
    obj: str  # her / him
    poss: str  # her / his

    @property
    def intro(self) -> str:
        return f"a {self.trait} {self.kind} named {self.name}"


def _character(rng: random.Random, exclude: frozenset[str] = frozenset()) -> Character:
    while True:
        roll = rng.randrange(10)
        trait = rng.choice(TRAITS)
        if roll < 4:
            name, kind, pron = rng.choice(GIRLS), "girl", ("she", "her", "her")
        elif roll < 8:
            name, kind, pron = rng.choice(BOYS), "boy", ("he", "him", "his")
        else:
            kind, name = rng.choice(ANIMALS)
            pron = rng.choice([("she", "her", "her"), ("he", "him", "his")])
        if name not in exclude:
            return Character(name, kind, trait, *pron)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


class _Story:
    """Sentence helpers that share one RNG and one cast."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.hero = _character(rng)
        self.friend = _character(rng, frozenset({self.hero.name}))
        self.place_short, self.place = rng.choice(PLACES)
        self.thing = rng.choice(OBJECTS)
        self.lines: list[str] = []

    def pick(self, options: list[str]) -> str:
        return self.rng.choice(options)

    def say(self, sentence: str) -> None:
        self.lines.append(sentence)

    def opening(self) -> None:
        h = self.hero
        self.say(
            self.pick(
                [
                    f"Once upon a time, there was {h.intro}.",
                    f"Once upon a time, in {self.place}, there lived {h.intro}.",
                    f"One {self.pick(WEATHER)} day, {h.intro} went to {self.place}.",
                    f"There once was {h.intro} who lived near {self.place}.",
                ]
            )
        )
        self.say(
            self.pick(
                [
                    f"{_cap(h.subj)} loved to {self.pick(VERBS_PLAY)} with {h.poss} {self.thing}.",
                    f"{h.name} had a {self.thing} that {h.subj} loved very much.",
                    f"Every day, {h.name} liked to {self.pick(VERBS_PLAY)} in {self.place}.",
                    f"{h.name} was very {self.pick(FEELINGS_GOOD)} because the sun was shining.",
                ]
            )
        )

    def quote(self, who: Character, text: str) -> str:
        if text.endswith("?"):
            verb = self.pick(["asked", "asked", "said"])
        else:
            verb = self.pick(["said", "said", "shouted" if text.endswith("!") else "replied", "whispered"])
        if text.endswith("."):
            text = text[:-1] + ","  # "I will help," Tom said.
        if self.rng.randrange(3) == 0:
            return f'"{text}" {verb} {who.name}.'
        return f'"{text}" {who.name} {verb}.'

    def dialogue(self, *turns: tuple[Character, str]) -> None:
        """Say each ``(speaker, words)`` turn as a quote, in order (one back-and-forth)."""
        for who, text in turns:
            self.say(self.quote(who, text))

    def ending(self) -> None:
        h, f = self.hero, self.friend
        self.say(
            self.pick(
                [
                    f"From that day on, {h.name} and {f.name} were best friends.",
                    f"{h.name} smiled. It was the best day ever.",
                    f"That night, {h.name} went to bed {self.pick(FEELINGS_GOOD)} and tired.",
                    f"{h.name} and {f.name} played together until the sun went down.",
                    "And they all lived happily ever after.",
                ]
            )
        )
        if self.rng.randrange(3) == 0:
            self.say(
                self.pick(
                    [
                        "They learned that sharing makes everyone happy.",
                        f"{h.name} learned that it is good to be {self.pick(['kind', 'brave', 'patient', 'honest'])}.",
                        "The end.",
                    ]
                )
            )

    def text(self) -> str:
        # Paragraph breaks like TinyStories: opening, middle, ending.
        n = len(self.lines)
        cut1, cut2 = 2, max(3, n - 2)
        parts = [" ".join(self.lines[:cut1]), " ".join(self.lines[cut1:cut2]), " ".join(self.lines[cut2:])]
        return "\n\n".join(p for p in parts if p)


def _lost_and_found(s: _Story) -> None:
    h, f = s.hero, s.friend
    s.say(f"One day, {h.name} went to {s.place} with {h.poss} {s.thing}.")
    s.say(f"{_cap(h.subj)} played and played, but then {h.subj} could not find {h.poss} {s.thing}!")
    s.say(f"{h.name} felt {s.pick(FEELINGS_BAD)}.")
    s.say(s.quote(h, f"Where is my {s.thing}?"))
    s.say(f"Then {f.intro} came by.")
    s.say(s.quote(f, f"Do not be sad, {h.name}. I will help you look."))
    spot = s.pick(["under a big tree", "behind a bush", "near the water", "in the tall grass", "under a bench"])
    s.say(f"They looked everywhere. At last, {f.name} found the {s.thing} {spot}.")
    s.say(s.quote(h, f"Thank you, {f.name}! You are a good friend."))


def _sharing(s: _Story) -> None:
    h, f = s.hero, s.friend
    s.say(f"At {s.place}, {h.name} met {f.intro}.")
    s.say(f"{f.name} looked at the {s.thing} and wanted to play with it too.")
    s.say(s.quote(f, f"Can I play with your {s.thing}?"))
    if s.rng.randrange(2):
        s.say(s.quote(h, "No, it is mine!"))
        s.say(f"{f.name} was {s.pick(FEELINGS_BAD)} and walked away.")
        s.say(f"{h.name} played alone, but it was not fun anymore.")
        s.say(f'So {h.name} ran to {f.name} and said, "I am sorry. Let\'s play together."')
    else:
        s.say(s.quote(h, f"Yes, {f.name}! Let's play together."))
    s.say(f"They took turns with the {s.thing}, and they both laughed a lot.")


def _fear(s: _Story) -> None:
    h, f = s.hero, s.friend
    scary = s.pick(["the dark", "the big dog next door", "the loud thunder", "the deep water", "the tall slide"])
    s.say(f"But {h.name} was afraid of {scary}.")
    s.say(s.quote(h, f"I am scared of {scary}. What can I do?"))
    s.say(f"{_cap(f.intro)} sat next to {h.obj}.")
    s.say(s.quote(f, "It is okay to be scared. I will stay with you."))
    s.say(f"{h.name} took a deep breath and held {f.name}'s hand.")
    s.say(f"Slowly, {h.subj} was not scared anymore. {_cap(h.subj)} felt {s.pick(FEELINGS_GOOD)} and brave.")


def _helping(s: _Story) -> None:
    h, f = s.hero, s.friend
    trouble = s.pick(["was stuck in a tree", "had hurt a leg", "could not reach the apples", "was lost and crying"])
    s.say(f"One day at {s.place}, {h.name} saw {f.intro} who {trouble}.")
    s.dialogue((f, "Help! Can you help me, please?"), (h, "Yes, I will help you!"))
    s.say(f"{h.name} thought very hard. Then {h.subj} had an idea.")
    s.say(f"{_cap(h.subj)} got a long stick and a rope, and {h.subj} helped {f.name} step by step.")
    s.say(f'{f.name} was so {s.pick(FEELINGS_GOOD)}. "Thank you, {h.name}!" {f.subj} said.')


def _building(s: _Story) -> None:
    h, f = s.hero, s.friend
    thing = s.pick(["a sand castle", "a tall tower", "a little house for the birds", "a boat", "a snowman"])
    s.say(f"{h.name} and {f.name} wanted to make {thing} at {s.place}.")
    s.say(f"They worked and worked. {f.name} brought sticks and {h.name} brought stones.")
    thing = thing.replace("a ", "the ", 1)
    s.say(f"But then the wind blew, and {thing} fell down!")
    s.dialogue((f, "Oh no! Now we have to start again."), (h, "Don't worry. We can make it even better."))
    s.say(f"They tried again, and this time {thing} was big and strong.")


def _rainy_day(s: _Story) -> None:
    h, f = s.hero, s.friend
    s.say(f"One morning, it was raining. {h.name} could not go to {s.place}.")
    s.say(f"{h.name} was {s.pick(FEELINGS_BAD)}. {_cap(h.subj)} looked out of the window.")
    s.say(s.quote(h, "What can I do inside?"))
    s.say(f"Then {f.name} came to visit with {s.pick(['a game', 'some paper and paint', 'a funny book', 'a puzzle'])}.")
    s.say(f"They played all day, and they ate {s.pick(FOODS)} for lunch.")
    s.say("When the rain stopped, they saw a big rainbow in the sky.")


def _trip(s: _Story) -> None:
    h, f = s.hero, s.friend
    dest_short, dest = s.pick([p for p in PLACES if p[1] != s.place])
    s.say(f'One day, {h.name}\'s mom said, "Today we will go to {dest}."')
    s.say(
        f"{h.name} was so {s.pick(FEELINGS_GOOD)}! {_cap(h.subj)} packed {h.poss} {s.thing} and some {s.pick(FOODS)}."
    )
    s.say(f"At the {dest_short}, {h.subj} met {f.intro}.")
    s.dialogue((f, f"Hello! Do you want to {s.pick(VERBS_PLAY)} with me?"), (h, "Yes, please!"))
    s.say(
        f"They had so much fun. They saw {s.pick(['a big fish', 'a red bird', 'a tiny snail', 'a pretty butterfly'])}."
    )


def _birthday(s: _Story) -> None:
    h, f = s.hero, s.friend
    s.say(f"Today was {h.name}'s birthday. {_cap(h.subj)} was very {s.pick(FEELINGS_GOOD)}.")
    s.say(f"{h.poss.capitalize()} mom made {s.pick(FOODS)} and all the friends came.")
    s.say(f"{f.name} gave {h.name} a present. It was a new {s.pick(OBJECTS)}!")
    s.say(s.quote(h, "Wow! I love it. Thank you!"))
    s.say(f"They sang a song and played games at {s.place}.")


def _quarrel(s: _Story) -> None:
    h, f = s.hero, s.friend
    s.say(f"{h.name} and {f.name} were playing at {s.place}.")
    s.say(f"They both wanted the {s.thing} at the same time.")
    s.dialogue((f, f"Give me the {s.thing}!"), (h, "No, I had it first!"))
    s.say(f"They pulled and pulled, and the {s.thing} fell into the mud.")
    s.say(f"Now they were both {s.pick(FEELINGS_BAD)}.")
    s.dialogue((h, "I am sorry. I should not have pulled."), (f, "I am sorry too. Let's clean it together."))
    s.say(f"They washed the {s.thing} and it was as good as new.")


PLOTS = [_lost_and_found, _sharing, _fear, _helping, _building, _rainy_day, _trip, _birthday, _quarrel]


def generate_story(rng: random.Random) -> str:
    """One story (a few short paragraphs of plain text) drawn from ``rng``."""
    s = _Story(rng)
    s.opening()
    rng.choice(PLOTS)(s)
    if rng.randrange(4) == 0:  # some stories get a second episode, with a new friend
        s.say(
            s.pick(
                [
                    "Later that day, something else happened.",
                    "The next day, there was more fun.",
                    "After that, another surprise came.",
                ]
            )
        )
        s.friend = _character(rng, frozenset({s.hero.name}))
        rng.choice(PLOTS)(s)
    s.ending()
    return s.text()


def generate_stories(n: int, seed: int = 0) -> list[str]:
    """``n`` stories from seed ``seed``; the same arguments always give the same list.

    Raises ``ValueError`` for a negative ``n``.
    """
    if n < 0:
        raise ValueError(f"number of stories must be >= 0, got {n}")
    rng = random.Random(seed)
    return [generate_story(rng) for _ in range(n)]


def sample_corpus(n_train: int = 1000, n_val: int = 100, seed: int = 0) -> tuple[list[str], list[str]]:
    """The sample corpus: ``(train stories, validation stories)``, drawn from independent seeds.

    The defaults give about 580 KB of training text and 58 KB of validation text.
    """
    return generate_stories(n_train, seed), generate_stories(n_val, seed + 1_000_003)


def write_sample_corpus(directory: str | Path, n_train: int = 1000, n_val: int = 100, seed: int = 0) -> Path:
    """Write ``train.txt`` and ``validation.txt`` (stories separated by ``<|endoftext|>`` lines)
    into ``directory`` and return it; ``wiola train --data DIR`` reads that layout."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, val = sample_corpus(n_train, n_val, seed)
    for name, stories in (("train.txt", train), ("validation.txt", val)):
        (directory / name).write_text(f"\n{EOT}\n".join(stories) + "\n", encoding="utf-8")
    return directory


# ------------------------------------------------------------------ instruction examples
# Words an instruction may require: the stories' content words drawn from the lists above
# (single words, so "contains the word" is a whole-word test on the lowercased story).
REQUIRED_WORDS = sorted(
    {phrase.split()[-1] for phrase in OBJECTS}
    | {short for short, _ in PLACES}
    | {kind for kind, _ in ANIMALS}
    | set(TRAITS)
    | set(FEELINGS_GOOD)
    | set(FEELINGS_BAD)
    | set(WEATHER)
)
FEATURES = {"dialogue": '"', "a moral": " learned that "}


def story_words(story: str) -> set[str]:
    """The story's lowercased words (letters only): what a required word is looked up in."""
    return set("".join(c if c.isalpha() else " " for c in story.lower()).split())


def instruction(words: list[str], features: list[str]) -> str:
    """The user turn of an instruction example: the required words, then the features."""
    text = f"Write a short story. Words: {', '.join(words)}."
    return text + (f" Features: {', '.join(features)}." if features else "")


def generate_instruction(rng: random.Random, n_words: int = 3) -> dict[str, object]:
    """One TinyStories-Instruct-style example drawn from ``rng``: ``{"messages": [user, assistant],
    "words": [...], "features": [...]}``; the user asks for ``n_words`` words the story holds
    (from ``REQUIRED_WORDS``) and the features it has, the assistant writes the story."""
    while True:
        story = generate_story(rng)
        present = sorted(story_words(story) & set(REQUIRED_WORDS))
        if len(present) >= n_words:
            break
    words = rng.sample(present, n_words)
    features = [name for name, marker in FEATURES.items() if marker in story]
    return {
        "messages": [
            {"role": "user", "content": instruction(words, features)},
            {"role": "assistant", "content": story},
        ],
        "words": words,
        "features": features,
    }


def instruction_examples(n: int, seed: int = 0, n_words: int = 3) -> list[dict[str, object]]:
    """``n`` instruction examples from seed ``seed`` (the same arguments, the same list)."""
    if n < 0:
        raise ValueError(f"number of examples must be >= 0, got {n}")
    rng = random.Random(seed)
    return [generate_instruction(rng, n_words) for _ in range(n)]


def write_instruction_corpus(
    directory: str | Path, n_train: int = 2000, n_val: int = 200, seed: int = 0, n_words: int = 3
) -> Path:
    """Write ``train.jsonl`` and ``validation.jsonl`` (chat lines for ``wiola finetune
    --format chat``, with the required ``words`` and ``features`` kept beside the messages)
    into ``directory``; the two splits come from independent seeds. Returns ``directory``."""
    import json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, n, s in (("train.jsonl", n_train, seed), ("validation.jsonl", n_val, seed + 2_000_003)):
        lines = [json.dumps(example) for example in instruction_examples(n, s, n_words)]
        (directory / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory
