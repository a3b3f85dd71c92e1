"""Deterministic generator of TinyStories-style children's stories.

Used as the offline, embedded training corpus: no download is needed, and the same
``(num_stories, seed)`` always gives byte-identical text. The on-disk format matches
``TinyStories-train.txt``: each story is followed by a line holding ``<|endoftext|>``.

The same stories also make the embedded instruction set (``generate_instructions``): each is
asked for by a prompt naming facts it contains, written as JSONL ``{"prompt", "response",
"facts"}`` records (``data_path="embedded:instructions"``).

Only the standard library is used (gemmalab.task_metric is too), so importing this is cheap.
"""

import json
import os
import pathlib
import random
import tempfile
from collections.abc import Callable, Iterator, Sequence

from gemmalab.task_metric import Reply, follows, mentions, stem, words

__all__ = [
    "GENERATOR_VERSION",
    "PLOT_TYPES",
    "SEPARATOR",
    "INSTRUCTIONS_VERSION",
    "corpus_file_name",
    "embedded_corpus_path",
    "embedded_instructions_path",
    "generate_instructions",
    "generate_labeled_stories",
    "generate_stories",
    "instructions_file_name",
    "write_corpus",
    "write_instructions",
]

SEPARATOR = "<|endoftext|>"
# Bump whenever the generated text changes, so cached corpus files are invalidated.
GENERATOR_VERSION = 1

_PARA = "\n\n"

# A spec is a sequence of beats. A beat is either a literal template (always used; _PARA
# marks a possible paragraph break) or (probability, variants): with that probability one
# variant is picked. Templates use str.format_map fields filled from the story context.
_Beat = str | tuple[float, Sequence[str]]
_Spec = Sequence[_Beat]
_Ctx = dict[str, str]

# --------------------------------------------------------------------------------------
# Word pools
# --------------------------------------------------------------------------------------

_GIRLS = (
    "Amy", "Lily", "Sue", "Mia", "Anna", "Emma", "Lucy", "Sara", "Zoe", "Ella", "Ruby",
    "Kim", "Jenny", "Molly", "Daisy", "Rose", "Sophie", "Chloe", "Grace", "Lola", "Jane",
    "Kate", "Nina", "Ivy", "Maya", "Bella", "Hannah", "Julia",
)  # fmt: skip
_BOYS = (
    "Tom", "Ben", "Max", "Sam", "Tim", "Leo", "Jack", "Jake", "Bob", "Joe", "Finn", "Alex",
    "Ryan", "Jim", "Dan", "Luke", "Noah", "Eli", "Oscar", "Toby", "Henry", "Billy", "Ted",
    "Owen", "Mark", "Peter", "Adam",
)  # fmt: skip
# Amy (the project's sampling prompt) is drawn more often than the other girls.
_AMY_WEIGHT = 0.08

_PET_NAMES = (
    "Spot", "Buddy", "Fluffy", "Rex", "Coco", "Pip", "Biscuit", "Snowy", "Patch", "Rusty",
    "Socks", "Bubbles",
)  # fmt: skip
_PETS = ("dog", "cat", "puppy", "kitten", "bunny")

_TRAITS = (
    "kind", "happy", "curious", "brave", "shy", "friendly", "cheerful", "clever", "playful",
    "sweet", "gentle", "smart", "funny", "helpful", "honest", "busy",
)  # fmt: skip

_HOMES = (
    "a small town", "a little house", "a big city", "a quiet village",
    "a little house by the sea", "a cozy house near the woods", "an old farmhouse",
    "a yellow house on a hill",
)  # fmt: skip

_HOBBIES = (
    "play outside", "draw pictures", "sing songs", "dance", "read books", "run and jump",
    "build with blocks", "look at the stars", "ride {his} bike", "play in the mud",
    "splash in puddles", "climb trees", "bake cookies", "paint", "play dress-up",
    "chase butterflies", "pick flowers", "play with {his} toys", "listen to stories",
)  # fmt: skip

_TOYS = (
    "ball", "doll", "teddy bear", "kite", "toy car", "toy truck", "toy train", "robot",
    "puzzle", "drum", "yo-yo", "spinning top", "toy boat", "jump rope", "stuffed bunny",
    "toy plane", "whistle", "balloon", "bucket", "hula hoop", "toy dinosaur", "music box",
    "puppet", "rocket", "rag doll", "toy horse",
)  # fmt: skip
_TOY_ADJS = (
    "red", "blue", "green", "yellow", "pink", "purple", "orange", "big", "little", "shiny",
    "new", "old",
)  # fmt: skip

_SHARE_FOODS = (
    "cookie", "big cookie", "chocolate cookie", "cheese sandwich", "jam sandwich",
    "blueberry muffin", "pink cupcake", "candy bar", "banana", "orange", "apple",
    "big red apple", "slice of pizza", "piece of cake",
)  # fmt: skip
# Nouns that appear in object lists elsewhere: things found, given or used.
_THINGS = (
    "book", "hat", "scarf", "cup", "umbrella", "shell", "rock", "flower", "box", "key",
    "bell", "blanket", "pillow", "coat", "map", "ring", "feather", "leaf", "stick", "coin",
    "picture", "letter", "basket", "lamp", "jar", "spoon", "backpack", "necklace", "egg",
)  # fmt: skip
_SHINY_FINDS = (
    "a shiny coin", "a pretty shell", "a blue feather", "a smooth white rock",
    "an old key", "a tiny bell", "a red ring", "a round orange leaf",
)  # fmt: skip

_ANIMAL_PLURALS = {
    "dog": "dogs", "cat": "cats", "bird": "birds", "rabbit": "rabbits", "duck": "ducks",
    "frog": "frogs", "fish": "fish", "bear": "bears", "mouse": "mice", "squirrel": "squirrels",
    "owl": "owls", "cow": "cows", "pig": "pigs", "horse": "horses", "sheep": "sheep",
    "lion": "lions", "fox": "foxes", "turtle": "turtles", "butterfly": "butterflies",
    "bee": "bees", "elephant": "elephants", "monkey": "monkeys", "ant": "ants",
}  # fmt: skip

# Lost animals: (animal, its home, where the home is).
_LOST_ANIMALS = (
    ("bird", "nest", "up in a tall tree"),
    ("rabbit", "burrow", "under a big bush"),
    ("duck", "family", "by the pond"),
    ("frog", "pond", "behind the old barn"),
    ("squirrel", "home", "in an old oak tree"),
    ("mouse", "hole", "by the garden wall"),
    ("fox", "den", "at the edge of the forest"),
    ("turtle", "pond", "behind the hill"),
    ("owl", "nest", "high in a big tree"),
    ("bee", "hive", "in the apple tree"),
    ("ant", "anthill", "next to the path"),
    ("hedgehog", "nest", "under a pile of leaves"),
)

_FIND_SPOTS = (
    "under the couch", "behind the big chair", "in the garden", "under a pile of leaves",
    "in the sandbox", "under the kitchen table", "next to the front door",
    "in the back of the car", "behind the curtains", "under {his} blanket",
    "in the laundry basket",
)  # fmt: skip

_MEET_PLACES = ("the park", "the playground", "the beach", "the library", "the pool", "school")

_GAMES = ("tag", "hide and seek", "catch", "on the swings", "in the sandbox", "with a ball")

_ONE_DAY = ("One day,", "One day,", "One day,", "One morning,", "One afternoon,", "One Saturday,")

_AGES = (("three", "third"), ("four", "fourth"), ("five", "fifth"), ("six", "sixth"),
         ("seven", "seventh"))  # fmt: skip

# Trips: place -> (activities, sights, small events). Activities are past-tense verb phrases
# that fit after both "they" and a name; sights fit after "saw".
_TRIPS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "the beach": (
        ("built a big sand castle", "looked for shells", "splashed in the waves",
         "dug a deep hole in the sand", "flew a kite in the wind", "ate ice cream"),
        ("a little crab", "a big white seagull", "a starfish", "a boat far away"),
        ("A big wave came and washed away {his} sand castle. {name} laughed and built"
         " another one.",
         "{name} found a pretty pink shell and put it in {his} pocket to keep."),
    ),
    "the park": (
        ("played on the swings", "went down the slide", "fed the ducks", "played catch",
         "ran on the green grass", "had a picnic under a tree"),
        ("a squirrel in a tree", "a family of ducks", "a big red balloon",
         "a dog chasing a ball"),
        ("A duck came very close and quacked at {him}. {name} giggled.",
         "{name} rolled down a little hill and got grass in {his} hair."),
    ),
    "the zoo": (
        ("looked at the lions", "watched the monkeys swing", "fed the goats",
         "watched the penguins swim", "rode on a little train"),
        ("a tall giraffe", "a big gray elephant", "a baby monkey", "a sleepy lion"),
        ("A monkey made a funny face at {name}, and {he} made one back.",
         "An elephant sprayed water with its trunk, and everyone laughed."),
    ),
    "the farm": (
        ("fed the chickens", "rode on a tractor", "picked apples", "petted a baby lamb",
         "collected eggs", "brushed a pony"),
        ("a pig rolling in the mud", "a baby horse", "a big brown cow", "a loud rooster"),
        ("A goat tried to eat {name}'s hat! Everyone laughed.",
         "A little chick hopped onto {name}'s shoe, so {he} held very still."),
    ),
    "the forest": (
        ("walked on a long path", "looked for pine cones", "listened to the birds",
         "had a picnic under a tall tree", "jumped over a small stream"),
        ("a deer", "a little rabbit", "a red fox", "an owl in a tree"),
        ("{name} found a blue feather on the path and put it in {his} pocket.",
         "A butterfly landed on {name}'s hand, and {he} held very still."),
    ),
    "the lake": (
        ("threw stones into the water", "went for a ride in a boat", "went fishing",
         "had a picnic by the water", "fed bread to the ducks"),
        ("a family of ducks", "a big green frog", "a fish jump out of the water",
         "a turtle on a log"),
        ("A fish jumped out of the water right next to {him}! {name} was so surprised.",
         "{name} caught a tiny fish, and then {he} let it go back into the water."),
    ),
    "the library": (
        ("read books about dinosaurs", "listened to a story", "found a book about space",
         "drew a picture", "looked at books with pictures of animals"),
        ("a book with a big dragon on it", "a shelf full of colorful books",
         "a fish tank with tiny fish"),
        ("The kind lady at the desk gave {name} a sticker.",
         "{name} picked three books to take home."),
    ),
    "the fair": (
        ("rode on the merry-go-round", "ate pink cotton candy", "played a ring game",
         "rode on the big wheel", "watched a puppet show"),
        ("a man juggling balls", "a clown with a red nose", "lots of bright lights"),
        ("{name} won a stuffed bear at a game. {He} named it {petname}.",
         "A clown gave {name} a red balloon."),
    ),
    "Grandma's house": (
        ("baked cookies", "played in the garden", "looked at old pictures",
         "helped feed the cat", "read a story on the big chair"),
        ("a cat sleeping in the sun", "a garden full of flowers", "a big old clock"),
        ("Grandma gave {name} a big hug and a warm cookie.",
         "Grandpa showed {name} how to whistle."),
    ),
    "the aquarium": (
        ("looked at the fish", "watched the sharks swim", "touched a starfish",
         "watched a seal show"),
        ("an octopus", "a jellyfish", "a big turtle", "a shark with sharp teeth"),
        ("A big turtle swam right up to the glass and looked at {name}.",
         "A seal clapped its flippers, and {name} clapped too."),
    ),
    "the museum": (
        ("looked at big dinosaur bones", "looked at old paintings",
         "learned about the moon", "looked at shiny rocks"),
        ("a huge dinosaur", "an old ship", "a real space suit"),
        ("{name} stood next to a giant dinosaur. {He} was so small next to it!",
         "{name} pressed a button, and a little train started to move."),
    ),
    "the playground": (
        ("climbed the monkey bars", "went down the big slide", "played in the sandbox",
         "swung on the swings", "played tag"),
        ("a boy flying a kite", "a bird on the fence", "a puppy playing with a stick"),
        ("{name} went so high on the swing that {he} felt like {he} could touch the sky.",
         "{name} made a new friend in the sandbox."),
    ),
    "the store": (
        ("pushed the cart", "picked out some apples", "looked at the toys",
         "found some bread and milk"),
        ("a tall stack of cans", "a big cake in a window", "lots of colorful fruit"),
        ("{name} helped put the food in the cart.",
         "The man at the store gave {name} a little sticker."),
    ),
    "the circus": (
        ("watched the clowns", "ate popcorn", "clapped for the acrobats",
         "watched a dog jump through a hoop"),
        ("a man on a tall bike", "an elephant standing on a ball", "a lady on a high rope"),
        ("A clown threw a bucket of paper at the people. Everyone laughed.",
         "A clown gave {name} a red balloon."),
    ),
}  # fmt: skip

# --------------------------------------------------------------------------------------
# Grammar helpers
# --------------------------------------------------------------------------------------


def _a(phrase: str) -> str:
    """Prefix ``phrase`` with the right indefinite article."""
    low = phrase.lower()
    if low.startswith(("uni", "use", "one", "eu")):
        return "a " + phrase
    if low[0] in "aeiou" or low.startswith(("hon", "hour")):
        return "an " + phrase
    return "a " + phrase


def _cap(text: str) -> str:
    """Capitalise the first letter (also after a leading quote)."""
    i = 1 if text.startswith('"') else 0
    return text[:i] + text[i : i + 1].upper() + text[i + 1 :]


def _pronouns(prefix: str, female: bool) -> _Ctx:
    he, him, his, himself = ("she", "her", "her", "herself") if female else (
        "he", "him", "his", "himself")  # fmt: skip
    return {
        prefix + "he": he,
        prefix + "He": he.capitalize(),
        prefix + "him": him,
        prefix + "his": his,
        prefix + "His": his.capitalize(),
        prefix + "himself": himself,
    }


def _run(r: random.Random, spec: _Spec) -> list[str]:
    out: list[str] = []
    for beat in spec:
        if isinstance(beat, str):
            out.append(beat)
            continue
        p, variants = beat
        if p >= 1.0 or r.random() < p:
            out.append(r.choice(variants))
    return out


def _context(r: random.Random) -> _Ctx:
    female = r.random() < 0.5
    amy = female and r.random() < _AMY_WEIGHT
    name = "Amy" if amy else r.choice(_GIRLS if female else _BOYS)
    c: _Ctx = {"name": name, "kind": "girl" if female else "boy"}
    c.update(_pronouns("", female))

    f_female = r.random() < 0.5
    friend = name
    while friend == name:
        friend = r.choice(_GIRLS if f_female else _BOYS)
    c["friend"] = friend
    c["fkind"] = "girl" if f_female else "boy"
    c.update(_pronouns("f", f_female))

    mom = r.random() < 0.6
    c["par"] = "mom" if mom else "dad"
    c["Par"] = "Mom" if mom else "Dad"
    c.update(_pronouns("par", mom))

    pet_female = r.random() < 0.5
    c["pet"] = r.choice(_PETS)
    c["petname"] = r.choice(_PET_NAMES)
    c.update(_pronouns("pet", pet_female))

    o_female = r.random() < 0.5
    c["oldperson"] = "old woman" if o_female else "old man"
    c.update(_pronouns("o", o_female))

    toyn = r.choice(_TOYS)
    toy = f"{r.choice(_TOY_ADJS)} {toyn}" if r.random() < 0.6 else toyn
    c["toyn"] = toyn
    c["toy"] = toy
    c["a_toy"] = _a(toy)
    c["gift"] = _a(r.choice(_TOYS) if r.random() < 0.7 else r.choice(_THINGS))
    c["food"] = r.choice(_SHARE_FOODS)
    c["a_food"] = _a(c["food"])
    c["find"] = r.choice(_SHINY_FINDS)

    c["trait"] = r.choice(_TRAITS)
    c["hobby"] = r.choice(_HOBBIES).format_map(c)
    c["a_home"] = r.choice(_HOMES)
    c["age"], c["ordinal"] = r.choice(_AGES)
    c["OneDay"] = r.choice(_ONE_DAY)
    c["spot"] = r.choice(_FIND_SPOTS).format_map(c)
    return c


# --------------------------------------------------------------------------------------
# Plots. Each takes (rng, context), may add context fields, and returns beat templates.
# --------------------------------------------------------------------------------------


def _plot_lost_toy(r: random.Random, c: _Ctx) -> list[str]:
    if r.random() < 0.3:
        out = _run(r, [(1, (
            "{OneDay} {name} could not find {his} favorite toy, {a_toy}.",
            "{OneDay} {name} went to get {his} {toy}, but it was gone!",
            "{OneDay} {name} looked everywhere for {his} {toy}, but {he} could not find it.",
        ))])  # fmt: skip
    else:
        out = _run(r, [
            (1, (
                "{name} had {a_toy} that {he} loved very much.",
                "{name}'s favorite toy was {a_toy}.",
                "{name} had a special toy. It was {a_toy}.",
                "{name} loved {his} {toy} more than any other toy.",
            )),
            (0.6, (
                "{He} took it everywhere {he} went.",
                "{He} played with it every day.",
                "{He} even took it to bed at night.",
                "Every day, {he} played with it in {his} room.",
            )),
            _PARA,
            (1, (
                "{OneDay} {name} could not find {his} {toyn}.",
                "{OneDay} {name} went to play with {his} {toyn}, but it was not there.",
                "{OneDay} {name} looked for {his} {toyn}, but it was gone!",
            )),
        ])  # fmt: skip
    out += _run(r, [(1, (
        "{He} felt very sad, because {he} loved {his} {toyn} so much.",
        "{name} was so sad that {he} started to cry.",
        "{He} was worried. Where could it be?",
        '"Oh no!" said {name}. "Where is my {toyn}?"',
    ))])  # fmt: skip
    searches = (
        "{He} looked under {his} bed, but it was not there.",
        "{He} looked in the toy box, but there was no {toyn} there.",
        "{He} looked in the kitchen and in the bathroom.",
        "{He} looked behind the door and under the table.",
        '{He} asked {his} {par}, "Have you seen my {toyn}?" {parHe} had not seen it.',
    )
    out += r.sample(searches, r.choice((1, 2)))
    out.append(_PARA)
    who = r.random()
    if who < 0.35:
        out += _run(r, [
            (1, ("Then {his} friend {friend} came over to help, and {fhe} looked {spot}.",
                 "Then {friend} came to help. {fHe} looked {spot}.")),
            (1, ('"I found it!" {friend} shouted, and {fhe} held up the {toyn}.',
                 "There was the {toyn}! {friend} gave it back to {name}.")),
            (1, ('{name} was so happy. "Thank you, {friend}!" {he} said.',
                 '{name} gave {friend} a big hug. "You are the best friend ever!" {he} said.')),
        ])  # fmt: skip
    elif who < 0.55:
        out += _run(r, [
            (1, ("Then {his} {pet}, {petname}, ran into the room with something in {pethis}"
                 " mouth. It was the {toyn}!",
                 "Just then, {his} {pet}, {petname}, came in, and {pethe} was holding the"
                 " {toyn}!")),
            (1, ('"Good {pet}, {petname}!" {name} laughed. {He} gave {petname} a big hug.',
                 "{name} laughed, because {petname} wanted to play with the {toyn} too!")),
        ])  # fmt: skip
    elif who < 0.75:
        out += _run(r, [
            (1, ("{His} {par} helped {him} look. At last, {parhe} found the {toyn} {spot}.",
                 "{His} {par} came to help. {parHe} looked {spot}, and there it was!")),
            (1, ('"Thank you, {Par}!" {name} said. {He} gave {his} {par} a big hug.',
                 '{name} smiled from ear to ear. "Thank you, {Par}!" {he} said.')),
        ])  # fmt: skip
    else:
        out += _run(r, [
            (1, ("{name} thought hard. Where did {he} play last? Then {he} remembered!",
                 "{name} sat down and thought very hard, and then {he} had an idea.")),
            (1, ("{He} ran and looked {spot}. There it was!",
                 "{He} looked {spot}, and there was {his} {toyn}!")),
            (1, ('"I found it!" {name} shouted. {He} hugged {his} {toyn} tight.',
                 "{name} jumped up and down, because {he} was so happy to have {his}"
                 " {toyn} back.")),
        ])  # fmt: skip
    return out


def _plot_new_friend(r: random.Random, c: _Ctx) -> list[str]:
    c["mplace"] = r.choice(_MEET_PLACES)
    c["game"] = r.choice(_GAMES)
    with_parent = r.random() < 0.5
    if with_parent:
        setup = "{OneDay} {name} went to {mplace} with {his} {par}."
        nudge: tuple[str, ...] = (
            '{His} {par} smiled and said, "Go on, say hello. Maybe {fhe} wants a friend too."',
            '{His} {par} gave {him} a little push. "Be brave," {parhe} said.',
        )
    else:
        setup = r.choice((
            "{OneDay} {name} was playing all alone at {mplace}.",
            "{OneDay} {name} went to {mplace}. {He} did not know anyone there.",
        ))  # fmt: skip
        nudge = (
            'Then {he} thought, "Maybe {fhe} wants a friend too."',
            "Then {he} remembered that everyone feels shy sometimes.",
        )
    return _run(r, [
        setup,
        (1, (
            "{He} saw a {fkind} sitting alone on a bench.",
            "There {he} saw a new {fkind} that {he} did not know.",
            "{He} saw a {fkind} who looked sad and lonely.",
            "Near the slide, {he} saw a {fkind} with curly hair.",
        )),
        (0.6, (
            "{name} felt a little shy.",
            "{name} wanted to say hello, but {he} felt shy.",
            "{name} did not know what to say.",
        )),
        (0.5, nudge),
        _PARA,
        (1, (
            '{name} walked over and said, "Hi, I am {name}. What is your name?"',
            '{name} took a deep breath and walked over. "Hello! Do you want to play with me?"'
            " {he} asked.",
            '{name} waved and said, "Hi! Do you want to play with me?"',
        )),
        (1, (
            'The {fkind} smiled. "My name is {friend}. Yes, I would love to play!"',
            'The {fkind} looked up and smiled. "I am {friend}," {fhe} said. "I just moved'
            ' here."',
            '"I am {friend}," said the {fkind}. "Yes, let\'s play!"',
        )),
        (1, (
            "{name} and {friend} played {game} all afternoon.",
            "They played {game} and laughed a lot.",
            "They built a big sand castle together.",
            "They ran and jumped and had lots of fun.",
        )),
        (0.5, (
            'When it was time to go home, {friend} asked, "Can we play again tomorrow?"'
            ' "Yes!" said {name}.',
            "When it was time to go, they waved goodbye and promised to play again soon.",
        )),
    ])  # fmt: skip


def _plot_sharing(r: random.Random, c: _Ctx) -> list[str]:
    if r.random() < 0.4:
        return _run(r, [
            (1, (
                "{OneDay} {name}'s {par} gave {him} {a_food}.",
                "{OneDay} {name} had {a_food} for a snack.",
                "{OneDay} {name} got {a_food} as a treat.",
            )),
            (0.5, ("It looked so yummy.", "{name} could not wait to eat it.")),
            (1, (
                "Then {his} friend {friend} came over to play.",
                "Just then, {his} friend {friend} came to {his} house.",
            )),
            _PARA,
            (1, (
                '{friend} looked at the {food}. "That looks yummy," {fhe} said.',
                '"Can I have some?" asked {friend}.',
            )),
            (1, (
                '"No, it is mine!" said {name}. {He} held it close.',
                "{name} did not want to share, so {he} turned away.",
            )),
            (1, (
                "{friend} looked sad, because {fhe} was hungry too.",
                "{friend} looked down at {fhis} feet with a sad face.",
            )),
            (1, (
                "When {name} saw how sad {friend} was, {he} did not feel good inside.",
                '{name} remembered what {his} {par} always said: "Sharing is caring."',
            )),
            _PARA,
            (1, (
                "{name} broke the {food} in two and gave half to {friend}.",
                '"Here, let\'s share," said {name}. {He} gave {friend} half of the {food}.',
            )),
            (1, (
                "{friend} smiled a big smile, and they ate together and laughed.",
                '"Thank you, {name}!" said {friend}. The {food} tasted even better that way.',
            )),
        ])  # fmt: skip
    return _run(r, [
        (1, (
            "{OneDay} {name}'s grandma gave {him} {a_toy}.",
            "{OneDay} {name} got {a_toy} for being so good.",
            "{OneDay} {name} found {a_toy} in a big box with a bow.",
        )),
        (1, ("{He} loved it so much.", "{name} played with it all morning.")),
        (1, (
            "Then {his} friend {friend} came over to play.",
            "After lunch, {his} friend {friend} came to {his} house.",
        )),
        _PARA,
        (1, (
            '{friend} saw the {toyn} and said, "Can I play with it too?"',
            '"Wow! Can I have a turn?" asked {friend}.',
        )),
        (1, (
            '"No! It is mine," said {name}. {He} held the {toyn} tight.',
            '{name} did not want to share. "No, it is my {toyn}!" {he} said.',
        )),
        (1, (
            "{friend} looked sad, and {fhe} sat down without saying anything.",
            "{friend} felt sad and started to cry.",
        )),
        (1, (
            "{name} saw how sad {friend} was, and {he} did not like to see {his} friend"
            " sad.",
            '{name} remembered what {his} {par} always said: "Sharing is caring."',
            "Playing alone was not much fun anymore.",
        )),
        _PARA,
        (1, (
            '"Here, you can play with it too," {name} said. {He} gave the {toyn} to {friend}.',
            '{name} said, "I am sorry. Let\'s play with it together."',
        )),
        (1, (
            "{friend} smiled a big smile, and they took turns and played all day.",
            "They played together, and it was much more fun than playing alone.",
        )),
    ])  # fmt: skip


_FEARS: tuple[_Spec, ...] = (
    (
        (1, ("{name} was afraid of the dark.",
             "{name} did not like the dark, because it made {him} feel scared.")),
        (1, ("Every night, when {his} {par} turned off the light, {he} hid under {his} blanket.",
             "At night, {he} thought there were monsters under {his} bed.")),
        _PARA,
        (1, ('One night, {name} called for {his} {par}. "I am scared of the dark," {he} said.',
             'One night, {name} could not sleep. "{Par}, I am scared!" {he} called.')),
        (1, ('{Par} sat on the bed and turned on a little night light. "Look," {parhe} said.'
             ' "Your room is the same in the dark."',
             '{Par} gave {him} a hug. "Let\'s look together," {parhe} said. They looked under'
             " the bed. There were only some socks and an old {toyn}.")),
        (0.6, ("{name} looked around {his} room. {He} saw {his} books, {his} toys and {his}"
               " warm bed.",
               "{name} laughed. There were no monsters at all.")),
        (1, ("{name} was not afraid anymore, so {he} closed {his} eyes and fell asleep.",
             "Soon {name} felt safe. {He} hugged {his} {toyn} and went to sleep.")),
    ),
    (
        (1, ("{name} was scared of the big slide at the park.",
             "There was a very tall slide at the playground, and {name} was afraid of it.")),
        (1, ("All the other kids went down and laughed, but {name} just watched.",
             "Every time {he} climbed up, {he} got scared and climbed back down.")),
        _PARA,
        (1, ('{OneDay} {his} friend {friend} said, "Let\'s go down together!"',
             '{OneDay} {friend} saw {name} standing by the slide. "I was scared too at first,"'
             " {fhe} said.")),
        (0.6, ("{name} took a deep breath, even though {his} legs were shaking.",
               "{name} held {friend}'s hand and climbed to the top.")),
        (1, ("Then {he} sat down and let go. Whoosh! Down {he} went!",
             "{He} closed {his} eyes and slid down. Whee! It was so fast!")),
        (1, ('At the bottom, {name} jumped up and laughed. "Again!" {he} shouted.',
             '"That was fun!" {name} said with a big smile.')),
    ),
    (
        (1, ("{name} was afraid of the water.",
             "{name} did not like to swim. The water looked too big and deep.")),
        (1, ("When {his} family went to the lake, {he} only sat on the sand.",
             "At the pool, {he} always stayed at the side and watched the other kids splash.")),
        _PARA,
        (1, ('{OneDay} {his} {par} held out {parhis} hands. "I will hold you," {parhe} said.'
             ' "You are safe."',
             '{OneDay} {his} {par} said, "Let\'s try together. I will not let go."')),
        (1, ("{name} stepped into the water slowly, and it felt cool and nice.",
             "{name} put one foot in, then the other.")),
        (1, ("{Par} held {him} while {he} kicked {his} legs. Splash, splash!",
             "{He} kicked and splashed, and {Par} held {him} the whole time.")),
        (1, ("Soon {name} was laughing and playing in the water.",
             "After a while, {name} was not scared at all. {He} loved the water!")),
    ),
    (
        (1, ("Next door, there lived a big brown dog.", "{name}'s neighbor had a big black dog.")),
        (1, ("The dog barked very loud, and {name} was scared of it.",
             "Every time {name} walked by, the dog barked, and {name} ran away.")),
        _PARA,
        (1, ('{OneDay} the neighbor came out with the dog. "Do not be scared. This dog is very'
             ' friendly," {ohe} said.',
             '{OneDay} the {oldperson} next door waved at {name}. "Come and say hello to my'
             ' dog," {ohe} said.')),
        (1, ("{name} slowly held out {his} hand, and the dog gave it a lick.",
             "The dog wagged its tail and sat down next to {name}.")),
        (1, ("{name} giggled, because the dog was soft and friendly.",
             "{name} patted the dog on the head. It was not scary at all.")),
        (0.6, ("Now {name} and the dog are good friends.",
               "From then on, {name} waved to the dog every day.")),
    ),
    (
        (1, ("{name} was afraid of storms.",
             "{name} did not like thunder, because it was so loud.")),
        (1, ("{OneDay} the sky got dark, and a big storm came.",
             "{OneDay} big gray clouds filled the sky, and it began to rain.")),
        (1, ('"Boom!" went the thunder. {name} ran to {his} {par} and held on tight.',
             "When the thunder went boom, {name} hid under the table.")),
        _PARA,
        (1, ('{Par} picked {him} up. "Thunder is just a loud noise," {parhe} said. "It cannot'
             ' hurt you in here."',
             '{Par} sat with {him}. "Let\'s count after each flash of light," {parhe} said.')),
        (1, ("They watched the rain together from the window.",
             "They sat together and counted. One, two, three, four. The storm was moving"
             " away.")),
        (1, ("Soon {name} was not scared anymore. The storm even looked a little pretty.",
             "After a while, the storm was over, and {name} felt brave.")),
    ),
    (
        (1, ("{name} was going to school for the first time.",
             "Tomorrow was {name}'s first day at school.")),
        (1, ("{He} was scared. What if nobody liked {him}?",
             "{He} felt butterflies in {his} tummy and did not want to go.")),
        _PARA,
        (1, ('{His} {par} gave {him} a big hug. "You will have fun," {parhe} said.',
             '"It is okay to feel scared," said {his} {par}. "Just be yourself."')),
        (1, ("At school, the teacher had a kind smile. She showed {name} where to hang {his}"
             " coat.",
             "The classroom had lots of books, paints and toys.")),
        (1, ('Then a {fkind} named {friend} sat next to {name}. "Do you want to draw with me?"'
             " {fhe} asked.",
             "A {fkind} named {friend} shared {fhis} crayons with {name}.")),
        (1, ("By the end of the day, {name} did not want to go home!",
             'When {his} {par} came to pick {him} up, {name} said, "Can I come back'
             ' tomorrow?"')),
    ),
)  # fmt: skip


def _plot_fear(r: random.Random, c: _Ctx) -> list[str]:
    while c["trait"] in ("brave", "shy"):
        c["trait"] = r.choice(_TRAITS)
    return _run(r, r.choice(_FEARS))


def _plot_trip(r: random.Random, c: _Ctx) -> list[str]:
    place = r.choice(tuple(_TRIPS))
    acts, sights, events = _TRIPS[place]
    c["place"] = place
    chosen = r.sample(acts, r.choice((2, 2, 3)))
    if r.random() < 0.5:
        doing = f"First, they {chosen[0]}. Then they {chosen[1]}."
    else:
        doing = f"{{name}} {chosen[0]}. After that, {{he}} {chosen[1]}."
    if len(chosen) == 3:
        doing += f" Later, they {chosen[2]}."
    sight = r.choice(sights)
    out = _run(r, [
        (1, (
            "{OneDay} {name} went to {place} with {his} {par}.",
            "{OneDay} {name} and {his} {par} went to {place}.",
            '{OneDay} {name}\'s {par} said, "Let\'s go to {place} today!"',
            "{OneDay} {name} went on a trip to {place} with {his} family.",
        )),
        (0.7, (
            "{name} was so excited that {he} could not sit still.",
            "{name} was so happy that {he} jumped up and down and clapped {his} hands.",
            "{name} could not wait! {He} put on {his} shoes and ran to the door.",
        )),
        (0.5, (
            "{Par} packed some snacks and water in a big bag, and off they went.",
            "The sun was shining, and the sky was blue.",
            "It was a warm and sunny day, just right for a trip.",
        )),
        _PARA,
        doing,
        (1, (
            f"{{He}} saw {sight}.",
            f'Soon {{name}} saw {sight}. "Look, {{Par}}!" {{he}} said.',
            f"{{name}} saw {sight}. {{He}} had never seen that before!",
        )),
        (0.7, events),
        _PARA,
        (1, (
            "When the sun went down, they went home, tired but happy.",
            "On the way home, {name} fell asleep in the car.",
            'At the end of the day, {name} said, "Thank you, {Par}. That was so much fun!"',
        )),
    ])  # fmt: skip
    return out


def _plot_birthday(r: random.Random, c: _Ctx) -> list[str]:
    c["flavor"] = r.choice(("chocolate", "strawberry", "vanilla", "lemon", "banana"))
    c["pgame"] = r.choice(("tag", "hide and seek", "musical chairs", "catch", "freeze dance"))
    return _run(r, [
        (1, (
            "{OneDay} {name} woke up with a big smile, because it was {his} birthday!",
            "Today was a special day. It was {name}'s {ordinal} birthday!",
            "It was {name}'s birthday, and {he} was {age} years old today.",
        )),
        (0.6, (
            "{His} {par} made a big {flavor} cake with {age} candles on it.",
            "{His} {par} put up balloons and made a big {flavor} cake.",
        )),
        _PARA,
        (1, (
            "All of {his} friends came to the party, and {friend} came too.",
            "{His} friends came to {his} house for a party.",
            "Lots of friends came to the party, and {friend} was the first one there.",
        )),
        (1, (
            "They played {pgame} and ate cake and ice cream.",
            "They danced, sang songs and played {pgame}.",
            "They played games and laughed a lot.",
        )),
        (0.4, (
            "But then, {friend} dropped {fhis} piece of cake on the floor. {fHe} was sad."
            " {name} gave {fhim} half of {his} own piece.",
            "But {friend} did not win any games and looked sad. {name} gave {fhim} a"
            " balloon, and {fhe} smiled again.",
        )),
        (1, (
            "{friend} gave {name} a present. It was {gift}!",
            "{name} opened {his} presents. The best one was {gift}.",
            "{name} got {gift} from {his} {par}.",
        )),
        (1, (
            '"Thank you!" {name} said. "I love it!"',
            "{name} was so happy that {he} said thank you to everyone.",
        )),
        _PARA,
        (0.7, (
            'Then everyone sang "Happy Birthday." {name} made a wish and blew out the'
            " candles.",
            "{name} closed {his} eyes, made a wish and blew out all the candles.",
        )),
    ])  # fmt: skip


_HELPS: tuple[_Spec, ...] = (
    (
        (1, ("{OneDay} {name} was walking in the garden when {he} saw a little bird on the"
             " ground.",
             "{OneDay} {name} found a little bird under a tree.")),
        (1, ("The bird had a hurt wing and could not fly.",
             "The bird was hurt, and it could not fly.")),
        (0.7, ("{name} felt sorry for the little bird and wanted to help it.",
               '"Poor little bird," said {name}. "I will take care of you."')),
        _PARA,
        (1, ("{name} gently picked up the bird and took it home.",
             "{name} ran to get {his} {par}. They put the bird in a box with a soft"
             " blanket.")),
        (1, ("Every day, {name} gave the bird water and seeds.",
             "{name} took care of the bird every day and even sang songs to it.")),
        (1, ("After a few days, the bird's wing was better.",
             "Soon the bird was strong again.")),
        (1, ("It flew up into the sky and sang a happy song, as if to say thank you.",
             "{name} opened the box, and the bird flew away. It came back to sing at {his}"
             " window every morning.")),
    ),
    (
        (1, ("{OneDay} {name} heard a small sound outside.",
             "{OneDay} {name} was playing outside when {he} heard a little meow.")),
        (1, ("It was a kitten! The kitten was stuck up in a tall tree.",
             "{He} looked up. A little kitten was stuck in a tree, and it was too scared to"
             " come down.")),
        _PARA,
        (0.7, ("{name} wanted to help, but the tree was too tall for {him} to climb.",
               "The poor kitten was crying, and {name} felt sad for it.")),
        (1, ("{name} ran to get {his} {par}.", '"{Par}! Come quick!" {name} called.')),
        (1, ("{Par} got a ladder and climbed up the tree. {parHe} brought the kitten down"
             " safely.",
             "{Par} climbed up slowly and got the kitten.")),
        (1, ("The kitten purred and rubbed against {name}'s leg.",
             "{name} held the kitten and patted its soft fur.")),
        (0.6, ("Then a girl from down the street came running. It was her kitten! She"
               " thanked {name} again and again.",
               "Later, they found the kitten's owner. It was the {oldperson} next door.")),
    ),
    (
        (1, ("{OneDay} {name} was walking home with {his} {par}.",
             "{OneDay} {name} was at the store with {his} {par}.")),
        (1, ("{He} saw an {oldperson} drop a bag of apples. The apples rolled all over the"
             " ground.",
             "An {oldperson} was carrying a big bag. Oops! The bag broke, and oranges rolled"
             " everywhere.")),
        _PARA,
        (0.7, ("The {oldperson} could not bend down to pick them up.",
               "The {oldperson} looked very worried.")),
        (1, ("{name} ran over and helped pick them up.",
             "{name} did not wait. {He} picked them up one by one and put them back in the"
             " bag.")),
        (1, ('The {oldperson} smiled. "Thank you, you are very kind," {ohe} said.',
             '"What a kind child you are," said the {oldperson}.')),
        (0.6, ("{oHe} gave {name} a shiny red apple to say thank you.",
               "{oHe} patted {name} on the head and waved goodbye.")),
    ),
    (
        (1, ("{OneDay} {name} and {his} friend {friend} were running in the park.",
             "{OneDay} {name} was playing tag with {his} friend {friend}.")),
        (1, ("{friend} tripped on a rock, fell down and hurt {fhis} knee.",
             "Suddenly, {friend} fell down and started to cry. {fHis} knee was hurt.")),
        _PARA,
        (1, ("{name} stopped playing right away and helped {fhim} get up.",
             '{name} ran to {fhim}. "Are you okay?" {he} asked.')),
        (1, ("{He} took {friend} to {his} {par}. {Par} put a bandage on the knee.",
             "{name} held {friend}'s hand and walked {fhim} to {his} {par}, who put on a"
             " bandage.")),
        (1, ('{friend} smiled. "Thank you, {name}. You are a good friend."',
             "Soon {friend} felt better, and they played again.")),
    ),
    (
        (1, ("{OneDay} {name} saw that {his} {par} was very tired.",
             "{OneDay} {name}'s {par} had a lot of work to do.")),
        (1, ('"I want to help," {name} said to {himself}.',
             "{name} wanted to help, and {he} had a good idea.")),
        _PARA,
        (1, ("{He} put away all {his} toys and made {his} bed.",
             "{He} set the table for dinner and fed the {pet}.",
             "{He} swept the floor and watered the plants.")),
        (0.8, ("It was a lot of work, but {name} did not stop until it was all done.",
               "{He} even picked some flowers and put them in a cup.")),
        (1, ('{Par} was so surprised. "Thank you, {name}! You are a big help!" {parhe} said.',
             "When {his} {par} saw, {parhe} gave {name} a big hug.")),
    ),
)  # fmt: skip


def _plot_helping(r: random.Random, c: _Ctx) -> list[str]:
    return _run(r, r.choice(_HELPS))


_INDOOR = (
    ("build a fort", "They put blankets over the chairs and made a big fort. Inside, they read"
     " books with a flashlight."),
    ("bake cookies", "They mixed flour, sugar and eggs in a big bowl. Soon the whole house"
     " smelled sweet."),
    ("paint pictures", "{name} painted a big yellow sun, a green tree and a little house."),
    ("have a tea party", "{name} put {his} toys around a little table and poured pretend tea"
     " for everyone."),
    ("play hide and seek", "{name} hid behind the curtains, but {his} feet stuck out. {Par}"
     " found {him}, and they both laughed."),
    ("make music", "{name} banged on a pot like a drum, and {Par} sang a silly song."),
    ("do a puzzle", "They found all the corners first. Piece by piece, a picture of a big"
     " ship appeared."),
    ("put on a puppet show", "{name} made puppets out of old socks. {He} made them talk in"
     " funny voices."),
)  # fmt: skip


def _plot_rainy_day(r: random.Random, c: _Ctx) -> list[str]:
    act, doing = r.choice(_INDOOR)
    c["indoor"] = act
    return _run(r, [
        (1, (
            "{OneDay} {name} wanted to play outside, but it was raining.",
            "{OneDay} {name} woke up and looked out the window. It was raining hard.",
            "{OneDay} {name} wanted to go to the park, but big drops of rain began to fall.",
        )),
        (1, (
            '{name} was sad. "I want to play outside," {he} said.',
            "{He} sat by the window and watched the rain fall, feeling bored.",
            '"There is nothing to do," said {name} with a big sigh.',
        )),
        _PARA,
        (1, (
            '{His} {par} had an idea. "Let\'s {indoor}!" {parhe} said.',
            '"Why don\'t we {indoor}?" asked {his} {par}.',
        )),
        (0.7, ("{name} liked that idea very much.",
               "{name} smiled and jumped up. It sounded like fun!")),
        doing,
        (0.8, ("They had so much fun that they forgot all about the rain.",
               "{name} laughed and laughed. {He} was not bored anymore.")),
        _PARA,
        (0.7, (
            "Later, the rain stopped. The sun came out, and there was a big rainbow in the sky.",
            "When the rain stopped, {name} put on {his} boots and jumped in the puddles."
            " Splash!",
        )),
    ])  # fmt: skip


_MISTAKES: tuple[_Spec, ...] = (
    (
        (1, ("{OneDay} {name} was playing with a ball in the house.",
             "{OneDay} {name} was bouncing a ball in the living room.")),
        (0.6, ("{His} {par} had told {him} not to play ball inside.",
               "{He} knew that balls were for outside.")),
        (1, ("{He} threw the ball too hard. It hit a vase, and the vase fell and broke!",
             "The ball bounced off the wall and hit {his} {par}'s favorite vase. Crash!")),
        _PARA,
        (1, ("{name} was scared. {He} did not know what to do.",
             "{name} wanted to hide, but {he} knew that was not right.")),
        (1, ('{He} went to {his} {par} and said, "I am sorry. I broke the vase."',
             'Then {he} found {his} {par}. "{Par}, I did something bad," {he} said. "I broke'
             ' your vase. I am sorry."')),
        (1, ('{Par} gave {him} a hug. "Thank you for telling the truth," {parhe} said.',
             '{Par} looked sad, but then {parhe} smiled. "Accidents happen. I am glad you told'
             ' me."')),
        (0.6, ("They cleaned it up together.", "Together, they put the pieces in a box.")),
    ),
    (
        (1, ("{OneDay} {friend} built a tall tower with blocks.",
             "{OneDay} {name} and {friend} were playing with blocks. {friend} built a very tall"
             " tower.")),
        (1, ("{name} ran past and bumped it. The tower fell down!",
             "{name} wanted to see it up close, but {he} tripped. Down went the tower!")),
        (1, ("{friend} started to cry.", "{friend} was very upset.")),
        _PARA,
        (1, ("{name} felt bad.", "{name} felt a little hot in {his} face.")),
        (1, ('"I am sorry, {friend}. I did not mean to," {he} said.',
             '{He} said, "I am sorry. It was an accident."')),
        (1, ('"Let\'s build it again together," said {name}.',
             '"I will help you build a new one," {name} said.')),
        (1, ("They built an even taller tower. {friend} smiled again.",
             "Together, they made the best tower ever.")),
    ),
    (
        (1, ("{OneDay} {friend} drew a beautiful picture of a house.",
             "{OneDay} {name} and {friend} were drawing at the kitchen table.")),
        (1, ("{name} reached for the crayons and knocked over {his} juice. The juice spilled"
             " all over {friend}'s picture!",
             "{name} was not careful, and {his} cup of milk tipped over onto {friend}'s"
             " picture.")),
        _PARA,
        (1, ("{friend} was sad. {fHis} picture was all wet.",
             '"My picture!" cried {friend}.')),
        (1, ('{name} said, "I am so sorry, {friend}. I was not careful."',
             "{name} looked at {friend}. {He} knew {he} had to say sorry, and {he} did.")),
        (1, ("Then {he} had an idea. {He} drew a new picture just for {friend}.",
             "They got a new sheet of paper and drew a new picture together.")),
        (1, ("{friend} smiled. The new picture was even better.",
             '"Thank you," said {friend}. "I love it!"')),
    ),
    (
        (1, ("{OneDay} {name} took a cookie from the jar before dinner.",
             "{OneDay} {name} saw the cookie jar on the table. {He} took two cookies.")),
        (1, ("{His} {par} had said no cookies before dinner.",
             "{He} knew {he} was not supposed to.")),
        _PARA,
        (1, ('When {his} {par} asked, "Did you take a cookie?" {name} said, "No."',
             "{His} {par} saw crumbs on the floor. \"Did you eat a cookie?\" {parhe} asked.")),
        (1, ("But {name} felt bad inside. Telling a lie did not feel good.",
             "{name} looked down at {his} feet. {He} felt bad.")),
        (1, ('{name} said, "I am sorry, {Par}. I did take a cookie."',
             'Then {name} told the truth. "Yes, I took it. I am sorry."')),
        (1, ('{Par} hugged {him}. "Thank you for telling me the truth," {parhe} said.',
             '{Par} smiled. "I am proud of you for being honest," {parhe} said.')),
    ),
)  # fmt: skip


def _plot_mistake(r: random.Random, c: _Ctx) -> list[str]:
    return _run(r, r.choice(_MISTAKES))


def _plot_growing(r: random.Random, c: _Ctx) -> list[str]:
    c["plant"] = r.choice((
        "a big yellow sunflower", "a pretty red flower", "a plant full of red tomatoes",
        "a tall bean plant", "a little pink flower", "a plant with big orange pumpkins",
    ))  # fmt: skip
    return _run(r, [
        (1, (
            "{OneDay} {name}'s {par} gave {him} a small seed.",
            "{OneDay} {name} found a little seed in the garden.",
            "{OneDay} {name} helped {his} {par} in the garden. {Par} gave {him} a seed to plant.",
        )),
        (1, (
            "{He} dug a hole, put the seed in it and covered it with dirt.",
            "{name} planted the seed in a little pot by the window.",
        )),
        (1, (
            "Every day, {name} gave the seed some water.",
            "Each morning, {he} watered it and waited.",
        )),
        _PARA,
        (1, (
            'But nothing happened. "Why is it not growing?" {he} asked.',
            "After two days, there was still nothing. {name} felt sad.",
        )),
        (1, (
            '{Par} smiled and said, "Be patient. Good things take time."',
            '"Plants grow slowly," said {his} {par}. "Keep taking care of it."',
        )),
        (0.5, ("So {name} waited and waited.", "{name} kept watering it every day.")),
        (1, (
            "Then one morning, {he} saw a tiny green leaf!",
            "One day, a little green shoot came out of the dirt.",
        )),
        _PARA,
        (1, (
            "Day by day, it grew bigger. Soon there was {plant}.",
            "It grew and grew until it was {plant}.",
        )),
        (0.6, (
            '"Look, {Par}! My plant!" {name} shouted.',
            "{name} showed it to all of {his} friends.",
        )),
    ])  # fmt: skip


_SKILLS = (
    ("ride {his} bike without training wheels",
     "{He} got on, but {he} wobbled and fell down.",
     "{He} pedaled and pedaled. {He} was riding all by {himself}!"),
    ("fly {his} new kite",
     "{He} ran and ran, but the kite fell to the ground.",
     "A big wind came, and the kite went up, up, up into the sky!"),
    ("tie {his} shoes",
     "{He} tried, but the laces got all tangled.",
     "{He} made a loop, wrapped the lace around and pulled. It was a perfect bow!"),
    ("jump rope",
     "{He} tried, but the rope got caught on {his} feet.",
     "{He} jumped once, twice, ten times in a row!"),
    ("whistle",
     "{He} blew and blew, but only air came out.",
     "Then a loud, happy whistle came out!"),
    ("catch a ball",
     "{Par} threw the ball, but it bounced off {his} hands.",
     "This time, {he} caught the ball with both hands!"),
    ("build a tall tower of blocks",
     "{He} put the blocks up high, but the tower fell down.",
     "{He} put the big blocks at the bottom. The tower stood tall and did not fall!"),
    ("swing by {himself}",
     "{He} kicked {his} legs, but the swing hardly moved.",
     "{He} kicked out and pulled back. Soon {he} was swinging high!"),
)  # fmt: skip


def _plot_keep_trying(r: random.Random, c: _Ctx) -> list[str]:
    goal, fail, win = r.choice(_SKILLS)
    c["goal"] = goal.format_map(c)
    return _run(r, [
        (1, (
            "{OneDay} {name} wanted to learn to {goal}.",
            "{OneDay} {name} decided to {goal}.",
            "{name} really wanted to {goal}.",
        )),
        fail,
        (1, (
            "{He} felt sad and wanted to give up.",
            '"I can\'t do it!" {name} said. {He} was upset.',
            "{name} frowned. It was harder than {he} thought.",
        )),
        _PARA,
        (1, (
            '{His} {par} said, "Don\'t give up. Try again!"',
            '{friend} said, "You can do it! Just keep trying."',
            '"Everyone needs practice at first," said {his} {par}. "Try one more time."',
        )),
        (0.5, (
            "{name} tried again, but it still did not work.",
            "{He} tried again and again.",
        )),
        (1, (
            "{name} took a deep breath and tried one more time.",
            "{name} did not give up. {He} tried one more time.",
        )),
        win,
        _PARA,
        (1, (
            '"I did it!" {name} shouted.',
            "{name} was so proud. {He} smiled a big smile.",
            '"Look at me!" {name} called. {His} {par} clapped {parhis} hands.',
        )),
    ])  # fmt: skip


def _plot_lost_animal(r: random.Random, c: _Ctx) -> list[str]:
    animal, home, where = r.choice(_LOST_ANIMALS)
    c["animal"], c["ahome"], c["awhere"] = animal, home, where
    return _run(r, [
        (1, (
            "{OneDay} {name} was playing in the garden when {he} saw a little {animal}.",
            "{OneDay} {name} found a little {animal} sitting all alone under a tree.",
            "{OneDay} {name} heard a soft cry. {He} looked down and saw a tiny {animal}.",
        )),
        (1, ("The {animal} looked scared and sad.", "The little {animal} was shaking.")),
        (1, (
            '"What is wrong?" asked {name}. "I am lost," said the {animal}. "I cannot find'
            ' my {ahome}."',
            '"Hello, little {animal}. Are you lost?" asked {name}. The {animal} nodded.',
        )),
        _PARA,
        (1, (
            '"Don\'t worry. I will help you get home," said {name}.',
            '{name} smiled. "I will help you," {he} said.',
        )),
        (1, (
            "They walked past the flowers and over a little bridge.",
            "{name} carried the {animal} carefully and looked all around.",
            "They looked by the big rock and behind the fence.",
        )),
        (1, (
            "At last, they found the {animal}'s {ahome} {awhere}.",
            "After a long walk, they found the {ahome}. It was {awhere}.",
        )),
        (1, (
            "The {animal}'s mom was so happy to see it.",
            'The little {animal} was so happy. "Thank you, {name}!" it said.',
        )),
        (0.5, (
            "{name} waved goodbye and went home with a big smile.",
            "{name} visited the {animal} again the next day.",
        )),
    ])  # fmt: skip


_PLOTS: tuple[tuple[str, Callable[[random.Random, _Ctx], list[str]]], ...] = (
    ("lost_toy", _plot_lost_toy),
    ("new_friend", _plot_new_friend),
    ("sharing", _plot_sharing),
    ("fear", _plot_fear),
    ("trip", _plot_trip),
    ("birthday", _plot_birthday),
    ("helping", _plot_helping),
    ("rainy_day", _plot_rainy_day),
    ("mistake", _plot_mistake),
    ("growing", _plot_growing),
    ("keep_trying", _plot_keep_trying),
    ("lost_animal", _plot_lost_animal),
)
PLOT_TYPES: tuple[str, ...] = tuple(name for name, _ in _PLOTS)

_MORALS: dict[str, tuple[str, ...]] = {
    "lost_toy": (
        "From then on, {name} always put {his} {toyn} in a safe place.",
        "{name} learned to take good care of {his} toys.",
        "{name} promised to be more careful with {his} things.",
        "{name} held {his} {toyn} close and never lost it again.",
    ),
    "new_friend": (
        "From that day on, {name} and {friend} were best friends.",
        "{name} was glad {he} was brave enough to say hello.",
        "{name} learned that a new friend can be just one hello away.",
    ),
    "sharing": (
        "{name} learned that sharing makes everyone happy.",
        "{name} learned that it is more fun to share.",
        "From that day on, {name} always shared with {his} friends.",
        "Sharing made {name} feel warm and happy inside.",
    ),
    "fear": (
        "{name} learned that being brave means trying even when you are scared.",
        "{name} felt very proud of {himself}.",
        "{name} learned that things are not always as scary as they seem.",
        "Now {name} knew that {he} could be brave.",
    ),
    "trip": (
        "It was a wonderful day.",
        "{name} could not wait to go back to {place} again.",
        "{name} would always remember that special day.",
        "That night, {name} dreamed about {place}.",
    ),
    "birthday": (
        "It was the best birthday ever.",
        "{name} went to bed with a big smile on {his} face.",
        "{name} thought it was the best day of {his} life.",
    ),
    "helping": (
        "{name} felt warm and happy inside. Helping others felt good.",
        "{name} learned that helping others is a good thing to do.",
        "{name} was glad {he} could help.",
        "{name} learned that even a small child can be a big helper.",
    ),
    "rainy_day": (
        "{name} learned that a rainy day can be fun too.",
        '"Rainy days are the best!" said {name}.',
        "It was a fun day after all.",
    ),
    "mistake": (
        "{name} learned that it is always best to tell the truth.",
        "{name} learned that saying sorry can make things better.",
        "{name} learned to be more careful.",
        "{name} felt much better after saying sorry.",
    ),
    "growing": (
        "{name} learned that good things take time.",
        "{name} was very proud of {his} plant.",
        "{name} learned to be patient.",
    ),
    "keep_trying": (
        "{name} learned to never give up.",
        "{name} learned that if you keep trying, you can do it.",
        "{name} learned that practice helps you get better.",
    ),
    "lost_animal": (
        "{name} felt happy that {he} had helped a new friend.",
        "{name} learned that even small helpers can do big things.",
        "{name} was glad {he} had been kind to the little {animal}.",
    ),
}

_CLOSERS = (
    "It was a very good day.",
    "{name} felt happy all day long.",
    "{He} went to bed that night with a happy heart.",
    "And they all lived happily ever after.",
    "The end.",
)

# Openings: (template, weight). "{trait}" openings suppress the trait sentence.
_OPENINGS = (
    ("Once upon a time, there was a {kind} named {name}.", 30),
    ("Once upon a time, there was a little {kind} named {name}.", 14),
    ("Once upon a time, there was {a_trait} little {kind} named {name}.", 8),
    ("Once upon a time, in {a_home}, there lived a {kind} named {name}.", 6),
    ("There was a {kind} named {name}.", 5),
    ("There was once a little {kind} called {name}.", 4),
    ("Once there was {a_trait} {kind} named {name}.", 4),
    ("{name} was {a_trait} little {kind}.", 5),
    ("{name} was a little {kind} who was {age} years old.", 3),
    ("Once upon a time, there was a {kind} called {name}. {He} was {age} years old.", 3),
)
_OPENING_CUM: list[int] = []
for _, _w in _OPENINGS:
    _OPENING_CUM.append((_OPENING_CUM[-1] if _OPENING_CUM else 0) + _w)
_INTRO_PREFIXES = (
    "One day, a little {kind} named {name} ",
    "One day, a {kind} named {name} ",
    "One day, {a_trait} {kind} named {name} ",
)
_INTRO_PROB = 0.2
_MIN_WORDS = 70
_TRAIT_LINES = (
    "{He} loved to {hobby}.",
    "{He} liked to {hobby} more than anything.",
    "{He} was very {trait}.",
    "{He} lived with {his} mom and dad in {a_home}.",
    "{He} had a {pet} named {petname}.",
    "Every day, {he} liked to {hobby}.",
)


def _story(r: random.Random) -> tuple[str, str, _Ctx]:
    """``(plot, story, context)``: the context holds the facts the story was built from."""
    plot, fn = _PLOTS[r.randrange(len(_PLOTS))]
    c = _context(r)
    beats = fn(r, c)
    c["a_trait"] = _a(c["trait"])

    head = "{OneDay} {name} "
    if beats[0].startswith(head) and r.random() < _INTRO_PROB:
        beats[0] = r.choice(_INTRO_PREFIXES) + beats[0][len(head) :]
        parts = beats
    else:
        k = r.randrange(_OPENING_CUM[-1])
        opening = next(t for (t, _), cum in zip(_OPENINGS, _OPENING_CUM, strict=True) if k < cum)
        parts = [opening]
        for line in r.sample(_TRAIT_LINES, r.choice((0, 1, 1, 1, 2))):
            clash = ("{trait}" in line and "trait}" in opening) or (
                "{a_home}" in line and "{a_home}" in opening)  # fmt: skip
            if not clash:
                parts.append(line)
        parts += beats

    ending: list[str] = []
    moral = r.random() < 0.8
    if moral:
        ending.append(r.choice(_MORALS[plot]))
    if not moral or r.random() < 0.25:
        closer = r.choice(_CLOSERS if moral else _CLOSERS[:-1])
        if closer.startswith("And they all") and "{friend}" not in "".join(parts):
            closer = _CLOSERS[0]
        ending.append(closer)
    parts.append(_PARA)
    parts += ending

    paragraphs = r.random() < 0.5
    chunks: list[str] = []
    for p in parts:
        if p == _PARA:
            if paragraphs and chunks and chunks[-1] != _PARA:
                chunks.append(_PARA)
            continue
        if chunks and chunks[-1] != _PARA:
            chunks.append(" ")
        chunks.append(_cap(p.format_map(c)))
    while chunks and chunks[-1] == _PARA:
        chunks.pop()
    return plot, "".join(chunks).strip(), c


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def _stories_with_context(num_stories: int, seed: int) -> Iterator[tuple[str, str, _Ctx]]:
    if num_stories < 0:
        raise ValueError(f"num_stories must be >= 0, got {num_stories}")
    r = random.Random(seed)
    for _ in range(num_stories):
        plot, story, c = _story(r)
        # Redraw the rare stories whose random choices all came out short.
        for _ in range(10):
            if len(story.split()) >= _MIN_WORDS:
                break
            plot, story, c = _story(r)
        yield plot, story, c


def generate_labeled_stories(num_stories: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """Yield ``(plot_type, story)`` pairs; the stories are those of :func:`generate_stories`."""
    for plot, story, _ in _stories_with_context(num_stories, seed):
        yield plot, story


def generate_stories(num_stories: int, seed: int = 0) -> Iterator[str]:
    """Yield ``num_stories`` stories, deterministically for a given ``seed``."""
    for _, story in generate_labeled_stories(num_stories, seed):
        yield story


# --------------------------------------------------------------------------------------
# Instructions: the same stories, each asked for by a prompt that states its facts
# --------------------------------------------------------------------------------------

# Bump whenever the instruction wording or facts change (the stories follow GENERATOR_VERSION).
INSTRUCTIONS_VERSION = 2

# A request: (marker, predicates, {fact: value}). It fits a story when the story contains the
# marker (any of its "|"-separated alternatives; "" always fits), every field it names is known
# and the story states every fact (``task_metric.mentions``). Predicates are wordings of one
# request, written to follow "a girl named Mia who ..."; they paraphrase the story rather than
# quote it, since a reply's words copied from its prompt do not count (``task_metric``).
_Request = tuple[str, tuple[str, ...], dict[str, str]]
# Per plot, most specific first: the first that fits is asked for.
_REQUESTS: dict[str, tuple[_Request, ...]] = {
    "lost_toy": (
        ("{friend} came", ("loses {his} {toyn}, and {his} friend {friend} helps {him} find it",
                           "cannot find {his} {toyn} until {his} friend {friend} helps"),
         {"toy": "{toyn}", "friend": "{friend}"}),
        ("{his} {pet}, {petname},", ("loses {his} {toyn}, and {his} {pet} {petname} finds it",),
         {"toy": "{toyn}", "pet": "{pet}", "pet name": "{petname}"}),
        ("{His} {par} helped {him} look|{His} {par} came to help",
         ("loses {his} {toyn} and finds it with help from {his} {par}",),
         {"toy": "{toyn}", "parent": "{par}"}),
        ("", ("loses {his} {toyn}", "cannot find {his} {toyn}",
              "searches the house for {his} missing {toyn}",
              "loses {his} favorite {toyn} and looks all over for it"), {"toy": "{toyn}"}),
    ),
    "new_friend": (
        ("", ("makes friends with {friend} at {mplace}",
              "meets a new friend named {friend} at {mplace}",
              "goes to {mplace} and makes friends with a {fkind} named {friend}"),
         {"friend": "{friend}", "place": "{mplace}"}),
        ("", ("makes a new friend named {friend}",
              "meets a {fkind} called {friend} and they become friends"), {"friend": "{friend}"}),
    ),
    "sharing": (
        ("half of the {food}|the {food} in two",
         ("learns to share {his} {food} with {friend}",
          "shares {his} {food} with {his} friend {friend}",
          "has {a_food} and learns to share it with {friend}"),
         {"food": "{food}", "friend": "{friend}"}),
        ("Can I play with it too|Can I have a turn",
         ("learns to share {his} new {toyn} with {friend}",
          "lets {his} friend {friend} play with {his} {toyn}",
          "learns to take turns with {friend} and {his} {toyn}"),
         {"toy": "{toyn}", "friend": "{friend}"}),
        ("", ("learns to share with {his} friend {friend}",
              "learns that sharing with {friend} is more fun"), {"friend": "{friend}"}),
        ("", ("learns to share", "learns that sharing is caring"), {}),
    ),
    "fear": (
        ("the dark", ("is afraid of the dark", "is scared of the dark at night",
                      "learns not to be afraid of the dark"), {"fear": "dark"}),
        ("slide", ("is scared of a tall slide", "is afraid to go down the big slide",
                   "learns to be brave on the slide"), {"fear": "slide"}),
        ("water", ("is afraid of the water", "learns to be brave in the water",
                   "is scared of the water but learns to swim"), {"fear": "water"}),
        ("barked", ("is scared of the dog next door", "is afraid of a big dog that barks",
                    "learns that a barking dog can be friendly"), {"fear": "dog"}),
        ("thunder", ("is afraid of thunder", "is scared of the sound of thunder"),
         {"fear": "thunder"}),
        ("school", ("is nervous about {his} first day at school", "is scared to start school",
                    "is afraid to go to school for the first time"), {"fear": "school"}),
        ("", ("learns to be brave", "finds out that {he} can be brave"), {}),
    ),
    "trip": (
        ("", ("goes to {place} and sees {sight}", "visits {place}, where {he} sees {sight}"),
         {"place": "{place}", "sight": "{sight}"}),
        ("", ("goes to {place}", "takes a trip to {place}", "spends a day at {place}",
              "visits {place}"), {"place": "{place}"}),
    ),
    "birthday": (
        ("", ("has a birthday party with a {flavor} cake and gets {gift}",
              "gets a {flavor} cake and {gift} on {his} birthday"),
         {"flavor": "{flavor}", "gift": "{gift}"}),
        ("", ("has a birthday party with a {flavor} cake",
              "gets a {flavor} cake for {his} birthday",
              "celebrates {his} birthday with a {flavor} cake"), {"flavor": "{flavor}"}),
        ("", ("gets {gift} for {his} birthday",
              "has a birthday party and gets {gift} as a present"), {"gift": "{gift}"}),
        ("", ("has a birthday party", "celebrates {his} birthday"), {}),
    ),
    "helping": (
        ("could not fly", ("takes care of a bird with a hurt wing",
                           "helps a hurt little bird get better",
                           "finds a hurt bird and looks after it"), {"animal": "bird"}),
        ("stuck", ("helps a kitten that is stuck in a tree",
                   "rescues a little kitten from a tall tree"), {"animal": "kitten"}),
        ("apples rolled", ("helps an {oldperson} pick up apples that fell on the ground",
                           "helps an {oldperson} whose apples spill everywhere"),
         {"person": "{oldperson}", "fruit": "apples"}),
        ("oranges rolled", ("helps an {oldperson} pick up oranges that fell on the ground",
                            "helps an {oldperson} whose oranges spill everywhere"),
         {"person": "{oldperson}", "fruit": "oranges"}),
        ("knee", ("helps {his} friend {friend}, who falls and hurts {fhis} knee",
                  "takes care of {his} friend {friend} after a fall"), {"friend": "{friend}"}),
        ("was very tired|a lot of work to do", ("helps {his} tired {par} around the house",
                                                "does chores to help {his} {par}"),
         {"parent": "{par}"}),
        ("", ("helps someone", "does something kind to help someone"), {}),
    ),
    "rainy_day": (
        ("", ("{indoor_does} on a rainy day", "stays inside on a rainy day and {indoor_does}",
              "cannot play outside in the rain, so {he} {indoor_does}"),
         {"activity": "{indoor_fact}"}),
        ("", ("has fun on a rainy day", "finds something fun to do on a rainy day"), {}),
    ),
    "mistake": (
        ("vase", ("breaks a vase and tells the truth", "breaks a vase by accident and says sorry"),
         {"thing": "vase"}),
        ("tower", ("knocks over {friend}'s tower of blocks",
                   "bumps into the block tower {friend} built and says sorry"),
         {"friend": "{friend}", "thing": "tower"}),
        ("juice|milk", ("spills a drink on {friend}'s picture",
                        "ruins {friend}'s picture by accident and makes a new one"),
         {"friend": "{friend}", "thing": "picture"}),
        ("cookie jar|from the jar", ("takes a cookie before dinner and then tells the truth",
                                     "eats a cookie before dinner and has to own up"),
         {"food": "cookie"}),
        ("", ("makes a mistake", "makes a mistake and says sorry"), {}),
    ),
    "growing": (
        ("", ("grows {plant_ask}", "grows {plant_ask} from a tiny seed",
              "plants a seed and grows {plant_ask}"), {"plant": "{plant_fact}"}),
    ),
    "keep_trying": (
        ("", ("learns how to {skill_ask}", "keeps trying until {he} can {skill_ask}",
              "wants to {skill_ask} and does not give up"), {"skill": "{skill_fact}"}),
    ),
    "lost_animal": (
        ("", ("helps a lost {animal} find its {ahome}",
              "helps a little {animal} get back to its {ahome}"),
         {"animal": "{animal}", "home": "{ahome}"}),
        ("", ("finds a lost {animal} and takes it home",), {"animal": "{animal}"}),
    ),
}  # fmt: skip

# What the story's own choices are called in a prompt (third person) and as a fact.
_INDOOR_ASKS = {
    "build a fort": ("builds a blanket fort", "fort"),
    "bake cookies": ("bakes cookies", "bake cookies"),
    "paint pictures": ("paints pictures", "paint pictures"),
    "have a tea party": ("has a pretend tea party", "tea party"),
    "play hide and seek": ("plays hide and seek", "hide and seek"),
    "make music": ("makes music", "music"),
    "do a puzzle": ("does a puzzle", "puzzle"),
    "put on a puppet show": ("makes a puppet show", "puppet show"),
}  # fmt: skip
_PLANT_ASKS = {
    "a big yellow sunflower": ("a sunflower", "sunflower"),
    "a pretty red flower": ("a red flower", "red flower"),
    "a plant full of red tomatoes": ("tomatoes", "tomatoes"),
    "a tall bean plant": ("a bean plant", "bean plant"),
    "a little pink flower": ("a pink flower", "pink flower"),
    "a plant with big orange pumpkins": ("pumpkins", "pumpkins"),
}  # fmt: skip
# Keyed by the goal's first word (see _SKILLS).
_SKILL_ASKS = {
    "ride": ("ride a bike without training wheels", "ride bike"),
    "fly": ("fly a kite", "fly kite"),
    "tie": ("tie {his} own shoes", "tie shoes"),
    "jump": ("jump rope", "jump rope"),
    "whistle": ("whistle", "whistle"),
    "catch": ("catch a ball", "catch ball"),
    "build": ("build a tower out of blocks", "tower blocks"),
    "swing": ("swing on {his} own", "swing"),
}  # fmt: skip

# How a prompt names its hero (never at the start of a sentence).
_INTROS = ("a {kind} named {name}", "a {kind} called {name}", "{name}, a little {kind},")
_ASKS = (
    "Write a story about {intro} who {predicate}.",
    "Tell me a short story about {intro} who {predicate}.",
    "Can you write a story for children about {intro} who {predicate}?",
    "Write a children's story in which {intro} {predicate}.",
    "Please write a bedtime story about {intro} who {predicate}.",
    "I would like a story about {intro} who {predicate}.",
    "Could you tell a simple story where {intro} {predicate}?",
    "Write a short, happy story for kids. It is about {intro} who {predicate}.",
    "Tell a story for little children about {intro} who {predicate}.",
    "Make up a story in which {intro} {predicate}.",
    "I need a story for my class about {intro} who {predicate}.",
    "Write a simple story that a five-year-old can read, about {intro} who {predicate}.",
)  # fmt: skip
# Optional second sentences that ask for one more fact the story states: (marker, wordings,
# facts), as in _REQUESTS; used in about _EXTRA_SHARE of the prompts whose story allows one.
_EXTRAS: tuple[_Request, ...] = (
    ("{friend}", ("{His} friend {friend} should be in the story too.",
                  "Put {his} friend {friend} in it.", "Include {his} friend {friend}."),
     {"friend": "{friend}"}),
    ("a {pet} named {petname}|{his} {pet}, {petname},",
     ("{He} has a {pet} named {petname}.", "{His} {pet} is called {petname}.",
      "Give {him} a {pet} called {petname}."), {"pet": "{pet}", "pet name": "{petname}"}),
    ("to {hobby}.|to {hobby} more", ("{His} favorite thing is to {hobby}.",
                                     "Say that {he} loves to {hobby}."), {"hobby": "{hobby}"}),
)  # fmt: skip
_EXTRA_SHARE = 0.4
_TRIES = 6  # wordings tried per request before a less specific one


def _instruction_context(plot: str, story: str, c: _Ctx) -> _Ctx:
    """``c`` plus what prompts need to name the story's choices (see _INDOOR_ASKS ...)."""
    ctx = dict(c)
    if plot == "rainy_day":
        ctx["indoor_does"], ctx["indoor_fact"] = _INDOOR_ASKS[c["indoor"]]
    elif plot == "growing":
        ctx["plant_ask"], ctx["plant_fact"] = _PLANT_ASKS[c["plant"]]
    elif plot == "keep_trying":
        ask, ctx["skill_fact"] = _SKILL_ASKS[c["goal"].split()[0]]
        ctx["skill_ask"] = ask.format_map(c)
    elif plot == "trip":
        # Longer sights ("a big cake in a window") could only be restated by copying them.
        sights = [s for s in _TRIPS[c["place"]][1] if f"saw {s}" in story and len(s.split()) <= 4]
        if sights:
            ctx["sight"] = sights[0]
    return ctx


def _fill(template: str, ctx: _Ctx) -> str | None:
    """``template`` with ``ctx``'s fields, or None where it names a field ``ctx`` lacks."""
    try:
        return template.format_map(ctx)
    except KeyError:
        return None


def _fits(request: _Request, story: str, ctx: _Ctx) -> dict[str, str] | None:
    """The request's facts, if the story has its marker and states them all."""
    marker, _, facts = request
    markers = _fill(marker, ctx)
    if markers is None or (markers and not any(m in story for m in markers.split("|"))):
        return None
    values = {}
    for fact, template in facts.items():
        value = _fill(template, ctx)
        if value is None or not mentions(story, value):
            return None
        values[fact] = value
    return values


def _prompt(predicate: str, ctx: _Ctx, wording: random.Random) -> str:
    intro = wording.choice(_INTROS).format_map(ctx)
    return wording.choice(_ASKS).format(intro=intro, predicate=predicate)


def _extra(story: str, ctx: _Ctx, facts: dict[str, str], wording: random.Random
           ) -> tuple[str, dict[str, str]]:
    """Maybe a second sentence asking for one more fact the story states ('' if none): one
    that says something new (no word in common with ``facts``)."""
    if wording.random() >= _EXTRA_SHARE:
        return "", {}
    asked = {stem(w) for value in facts.values() for w in words(value)}
    fitting = [(e, f) for e in _EXTRAS if (f := _fits(e, story, ctx)) is not None
               and not asked & {stem(w) for value in f.values() for w in words(value)}]
    if not fitting:
        return "", {}
    (_, sentences, _), more = wording.choice(fitting)
    return " " + wording.choice(sentences).format_map(ctx), more


def _request(plot: str, story: str, c: _Ctx, wording: random.Random
             ) -> tuple[str, dict[str, str]]:
    """A prompt for ``story`` and its facts: the most specific request the story fulfils, in a
    wording the story answers in words of its own (``task_metric.follows``)."""
    ctx = _instruction_context(plot, story, c)
    hero = {"name": c["name"], "kind": c["kind"]}
    for request in _REQUESTS[plot]:
        facts = _fits(request, story, ctx)
        if facts is None:
            continue
        facts = {**hero, **facts}
        for _ in range(_TRIES):
            prompt = _prompt(wording.choice(request[1]).format_map(ctx), ctx, wording)
            if not _answers(story, prompt, facts):
                continue
            extra, more = _extra(story, ctx, facts, wording)
            if extra and _answers(story, prompt + extra, {**facts, **more}):
                return prompt + extra, {**facts, **more}
            return prompt, facts
    return "Tell me a story about {name}, a {kind}.".format_map(c), hero


def _answers(story: str, prompt: str, facts: dict[str, str]) -> bool:
    return follows(Reply(story, prompt, ended=True), facts)


def generate_instructions(num_instructions: int, seed: int = 0) -> Iterator[dict]:
    """Yield ``{"prompt", "response", "facts"}`` records: the stories of
    :func:`generate_stories` with the same arguments, each asked for by a prompt naming facts
    (name, kind, plus the plot's object, place, ...) that its story states in words of its
    own, so the story itself follows the instruction under ``task_metric``."""
    wording = random.Random(f"instructions-{seed}")  # the stories' own draws stay untouched
    for plot, story, c in _stories_with_context(num_instructions, seed):
        prompt, facts = _request(plot, story, c, wording)
        yield {"prompt": prompt, "response": story, "facts": facts}


def write_instructions(path: str | os.PathLike, num_instructions: int, seed: int = 0
                       ) -> pathlib.Path:
    """Write instruction records to ``path`` as JSONL (one ``{"prompt", "response", "facts"}``
    object per line): the format ``data_path`` accepts for instruction data."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8", newline="\n") as f:
        for record in generate_instructions(num_instructions, seed):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return out


def instructions_file_name(num_instructions: int, seed: int = 0) -> str:
    return (f"instructions-v{GENERATOR_VERSION}.{INSTRUCTIONS_VERSION}-n{num_instructions}"
            f"-s{seed}.jsonl")


def embedded_instructions_path(cache_dir: str | os.PathLike, num_instructions: int,
                               seed: int = 0) -> pathlib.Path:
    """The cached instruction set's path, generated once (atomically) if missing."""
    return _cached(pathlib.Path(cache_dir) / instructions_file_name(num_instructions, seed),
                   lambda tmp: write_instructions(tmp, num_instructions, seed))


def write_corpus(path: str | os.PathLike, num_stories: int, seed: int = 0) -> pathlib.Path:
    """Write stories to ``path`` in TinyStories format, each followed by the separator line."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tail = "\n" + SEPARATOR + "\n"
    with out.open("w", encoding="utf-8", newline="\n") as f:
        for story in generate_stories(num_stories, seed):
            f.write(story)
            f.write(tail)
    return out


def corpus_file_name(num_stories: int, seed: int = 0) -> str:
    """File name of a cached corpus; it encodes the generator version, size and seed."""
    return f"stories-v{GENERATOR_VERSION}-n{num_stories}-s{seed}.txt"


def embedded_corpus_path(
    cache_dir: str | os.PathLike, num_stories: int, seed: int = 0
) -> pathlib.Path:
    """Return the path of the cached corpus file, generating it once (atomic write: temp file
    + os.replace) if missing."""
    return _cached(pathlib.Path(cache_dir) / corpus_file_name(num_stories, seed),
                   lambda tmp: write_corpus(tmp, num_stories, seed))


def _cached(target: pathlib.Path, write: Callable[[str], object]) -> pathlib.Path:
    """``target``, written once by ``write(temporary path)`` then renamed into place."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return target
