"""Small data sets the recipe tests make, in the real file formats (GLUE TSV and CSV, CoNLL-2003, SQuAD JSON, SWAG
CSV, a pre-training corpus), the flags every test run passes, and hand-made question-answering windows."""

import csv
import json
import math
import random
from pathlib import Path


# ---------------------------------------------------------------------------------------------------------------------
# Fine-tuning recipes
# ---------------------------------------------------------------------------------------------------------------------
# Twelve labelled sentences (label: index % 2) for the runs that stop and resume run_glue.py on a tiny model.
SENTENCES = ["a lovely film", "a dreadful film", "great fun", "so boring", "truly wonderful", "awful acting",
             "a charming story", "a tedious plot", "brilliant music", "poor dialogue", "superb cast", "bad jokes"]
# Every run: CPU, no reporting, no checkpoints, no progress bars.
RECIPE_FLAGS = ["--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0",
          "--per_device_eval_batch_size", "32"]
POSITIVE = ["great", "wonderful", "excellent", "delightful", "fantastic", "lovely", "superb", "brilliant", "charming"]
NEGATIVE = ["awful", "terrible", "horrible", "dreadful", "boring", "disappointing", "bad", "poor", "miserable"]
THINGS = ["movie", "food", "service", "hotel", "book", "concert", "show", "trip", "game", "meal", "song", "class"]
FRAMES = ["the {} was {} .", "what a {1} {0} !", "i thought the {} was really {} ."]


def sentiment_rows(rng, n):
    rows = [(frame.format(thing, word), label) for frame in FRAMES for thing in THINGS
            for words, label in ((POSITIVE, 1), (NEGATIVE, 0)) for word in words]
    return rng.sample(rows, n)


def write_tsv(path, header, rows):
    with open(path, "w") as f:
        f.write("\t".join(header) + "\n")
        f.writelines("\t".join(map(str, row)) + "\n" for row in rows)


def sst2_files(folder, seed: int, train: int, dev: int) -> tuple:
    """SST-2's TSV layout (sentence, label): train.tsv and dev.tsv of `train` and `dev` sentiment rows in `folder`;
    their paths."""
    rows = sentiment_rows(random.Random(seed), train + dev)
    paths = folder / "train.tsv", folder / "dev.tsv"
    for path, part in zip(paths, (rows[:train], rows[train:])):
        write_tsv(path, ["sentence", "label"], part)
    return paths


PEOPLE = ["John", "Mary", "Peter", "Anna", "David", "Laura", "Michael", "Sarah", "James", "Emma", "Robert", "Linda"]
SURNAMES = ["Smith", "Brown", "Miller", "Wilson", "Taylor", "Clark"]
CITIES = ["Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Vienna", "Dublin", "Oslo", "Lisbon", "Cairo"]
ORGS = [["Google"], ["Microsoft"], ["United", "Nations"], ["Siemens"], ["Reuters"], ["Toyota"], ["Red", "Cross"]]
NER_FRAMES = ["P lives in L .", "P works for O in L .", "O opened an office in L .", "Yesterday P visited L .",
              "P met P at O .", "The weather in L was cold .", "P and P flew to L on Monday ."]


def ner_sentence(rng):
    """[(word, tag)] from a frame: P a person (sometimes with a surname), L a city, O an organisation."""
    out = []
    for slot in rng.choice(NER_FRAMES).split():
        if slot == "P":
            out.append((rng.choice(PEOPLE), "B-PER"))
            if rng.random() < 0.4:
                out.append((rng.choice(SURNAMES), "I-PER"))
        elif slot == "L":
            out.append((rng.choice(CITIES), "B-LOC"))
        elif slot == "O":
            article, *name = ["the"] + rng.choice(ORGS) if rng.random() < 0.3 else [None] + rng.choice(ORGS)
            out += [(article, "O")] if article else []
            out += [(w, "B-ORG" if i == 0 else "I-ORG") for i, w in enumerate(name)]
        else:
            out.append((slot, "O"))
    return out


def write_conll(path, sentences):
    with open(path, "w") as f:
        f.write("-DOCSTART- -X- -X- O\n\n")
        for sentence in sentences:
            f.writelines(f"{word} NNP B-NP {tag}\n" for word, tag in sentence)
            f.write("\n")


JOBS = ["teacher", "doctor", "pilot", "baker", "lawyer", "farmer", "nurse", "painter", "chef", "writer"]
FILLER = ["The weather was mild for most of the year.", "Many people enjoy long walks on the weekend.",
          "The old bridge was repaired after the storm.", "Most shops close early on Sundays.",
          "The library has a large collection of old maps.", "Trains run every twenty minutes in the morning.",
          "Local markets sell fresh fruit and vegetables.", "The museum was very busy during the holidays."]


def squad_article(rng, index):
    """One paragraph about one person (where they live, their job) among filler sentences, long enough to need two
    windows; one question: where does the person live."""
    person, city, job = rng.choice(PEOPLE), rng.choice(CITIES), rng.choice(JOBS)
    fact = f"{person} lives in {city}."
    sentences = rng.sample(FILLER, 7) + [fact, f"{person} works as a {job}."]
    rng.shuffle(sentences)
    context = " ".join(sentences)
    answer = {"text": city, "answer_start": context.index(fact) + len(f"{person} lives in ")}
    qa = {"id": str(index), "question": f"Where does {person} live?", "answers": [answer], "is_impossible": False}
    return {"title": f"article {index}", "paragraphs": [{"context": context, "qas": [qa]}]}


STATES = {
    "hungry": "ate a big sandwich.", "tired": "went straight to bed.", "cold": "put on a warm coat.",
    "thirsty": "drank a glass of water.", "dirty": "took a long shower.", "lost": "looked at a map.",
    "late": "ran to catch the bus.", "sick": "called a doctor.",
}
ABSURD = ["ate the moon with a spoon.", "married a teapot.", "swam across the ceiling.", "painted the wind blue.",
          "folded the river in half.", "sang to a brick until it cried.", "planted a chair in the sky.",
          "mailed the sunset to a fish."]


def swag_rows(rng, n):
    """A person in a state; the right ending suits the state, the wrong ones suit another state or none."""
    rows = []
    for _ in range(n):
        person, state = rng.choice(PEOPLE), rng.choice(list(STATES))
        endings = [STATES[rng.choice([s for s in STATES if s != state])]] + rng.sample(ABSURD, 2)
        label = rng.randrange(4)
        endings.insert(label, STATES[state])
        rows.append({"sent1": f"{person} felt very {state}.", "sent2": "So she" if person in PEOPLE[1::2] else "So he",
                     **{f"ending{i}": e for i, e in enumerate(endings)}, "label": label})
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Pre-training
# ---------------------------------------------------------------------------------------------------------------------
# A small corpus of varied English prose in the original BERT format: one sentence per line, documents separated by a
# blank line.
DOCUMENTS = [
    """The lighthouse stood at the end of a narrow spit of rock, and for more than a century it had warned ships away from the shoals.
Its keeper, an old man named Tobias, climbed the spiral stairs every evening to light the great lamp.
He kept a logbook in which he wrote down the weather, the passing vessels and the birds that rested on the railing.
In winter the storms came from the north, and the waves broke so high that spray reached the lantern room.
On calm nights he could hear seals calling to one another across the water.
When the lamp was finally automated, Tobias moved to the village, but he still walked to the point each evening to watch the light come on.""",
    """Photosynthesis is the process by which green plants turn light into chemical energy.
Inside the chloroplasts, chlorophyll absorbs mostly red and blue light and reflects green, which is why leaves look green to us.
The energy of the absorbed light splits water molecules, releasing oxygen as a by-product.
Carbon dioxide from the air is then fixed into sugars in a cycle of reactions named after Melvin Calvin.
Almost all the oxygen in the atmosphere was produced this way over billions of years.
Without photosynthesis, there would be no food chains on land and very little life in the oceans.""",
    """To bake a simple loaf of bread you need flour, water, salt and yeast.
Mix the ingredients into a rough dough and let it rest for twenty minutes so that the flour can absorb the water.
Then knead the dough on a floured table until it becomes smooth and elastic.
Leave it in a warm place, covered with a cloth, until it has doubled in size.
Shape the loaf, let it rise again, and bake it in a hot oven for about forty minutes.
The bread is done when the crust is deep brown and the bottom sounds hollow when tapped.""",
    """The city council met on Tuesday to discuss the new budget for public transport.
Several members argued that the bus network should be extended to the growing suburbs in the east.
Others wanted to spend the money on repairing the old tram lines that cross the historic centre.
After a long debate, the council agreed to a compromise that funds both projects over five years.
The mayor said the decision would make it easier for thousands of residents to reach their jobs without a car.
Construction on the first new bus routes is expected to begin next spring.""",
    """Marie had always wanted to learn the violin, but she only started at the age of forty.
Her first teacher told her that adults learn more slowly than children, yet practise more carefully.
For months the instrument squeaked and whined, and her neighbours politely closed their windows.
She practised scales every morning before work and played simple folk songs in the evenings.
After three years she joined an amateur orchestra that rehearsed in a school hall on Thursdays.
At her first concert her hands shook, but when the music began she forgot to be afraid.""",
    """Volcanoes form where molten rock from deep inside the Earth reaches the surface.
Many of them lie along the edges of tectonic plates, especially around the Pacific Ocean.
When pressure builds up in the magma chamber, gas and ash can burst out in a violent eruption.
Other volcanoes, like those of Hawaii, release runny lava that flows slowly down their slopes.
The ash from large eruptions can travel around the world and cool the climate for several years.
Scientists watch for small earthquakes and changes in the ground to predict when a volcano may erupt.""",
    """The old library had tall windows, creaking floors and shelves that reached the ceiling.
Students came there to study in silence, surrounded by the smell of paper and leather.
The librarian knew where every book was kept, even those that had been misplaced years ago.
In the basement there was a collection of maps drawn by sailors and explorers of past centuries.
One afternoon a young historian found a letter hidden between the pages of an atlas.
It had been written by a merchant to his daughter, describing a voyage to the spice islands.""",
    """A healthy diet includes plenty of vegetables, fruit, whole grains and legumes.
Proteins can come from fish, eggs, beans, nuts or lean meat.
Doctors recommend limiting sugar, salt and heavily processed foods.
Drinking enough water matters as much as eating well, especially in hot weather.
Regular meals help keep energy levels steady throughout the day.
Small changes, such as cooking at home more often, can make a large difference over time.""",
    """The football match was decided in the final minute of extra time.
Both teams had defended well, and the score was still level after ninety minutes.
The visiting side had more possession, but the home team created the better chances.
Just before the end, a young substitute ran down the left wing and crossed the ball into the box.
The captain rose above the defenders and headed it into the corner of the net.
The crowd erupted, and the players ran to celebrate with the fans behind the goal.""",
    """Computers store information as long sequences of zeros and ones called bits.
Eight bits form a byte, which can represent a single letter of text.
The processor reads instructions from memory, performs calculations and writes the results back.
Modern chips contain billions of tiny transistors that switch on and off billions of times per second.
Programs written by people in languages such as Python are translated into these simple instructions.
Despite their speed, computers only do exactly what they are told to do.""",
    """In the mountains the weather can change within an hour.
Hikers should carry warm clothes, a map and enough water even on a sunny morning.
Clouds that gather around the peaks in the afternoon often bring thunderstorms.
If lightning approaches, it is safest to leave the ridges and move down into the valley.
Experienced guides start their climbs before dawn so that they return before the storms arrive.
Many accidents happen on the way down, when people are tired and less careful.""",
    """The river flows slowly through the plain, bending in wide loops between fields and willows.
In spring the snowmelt from the hills makes it rise and sometimes flood the meadows.
Farmers once built their houses on small mounds so that they would stay dry during the floods.
Today dikes and canals control the water, and the floods have become rare.
Herons stand in the shallows, waiting patiently for fish to swim past.
In the evening the surface of the water turns gold and then grey as the sun goes down.""",
]
# Every training run: CPU, the tiny preset with the MiniLM vocabulary, short examples, no reporting or progress bars.
PRETRAINING_FLAGS = [
    "--config_name", "tiny", "--max_seq_length", "32", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
    "--seed", "0", "--per_device_train_batch_size", "8", "--dataloader_num_workers", "0",
]


def within_binomial(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    """count successes out of n is within `sigmas` binomial standard deviations of n * p."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def synthetic_corpus(num_documents: int, seed: int, sentences=(1, 25), tokens=(3, 40)) -> list[list[list[int]]]:
    """Documents of sentences of token ids, every token id unique and increasing through the corpus (from 1000), so
    that an id tells where in which document it comes from."""
    rng, next_id, docs = random.Random(seed), 1000, []
    for _ in range(num_documents):
        doc = []
        for _ in range(rng.randint(*sentences)):
            n = rng.randint(*tokens)
            doc.append(list(range(next_id, next_id + n)))
            next_id += n
        docs.append(doc)
    return docs


def training_logs(output_dir) -> list[dict]:
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


def logged_losses(output_dir) -> dict[int, float]:
    """{step: loss} of the run's trainer_state.json."""
    return {entry["step"]: entry["loss"] for entry in training_logs(output_dir)}


# ---------------------------------------------------------------------------------------------------------------------
# Question answering: one context in two windows
# ---------------------------------------------------------------------------------------------------------------------
# The context "aa bb cc dd ee ff" in windows of 3 context tokens sharing one: [CLS] q [SEP] aa bb cc [SEP] and
# [CLS] q [SEP] cc dd ee [SEP] (a third window would hold "ee ff"; two are enough here).
CONTEXT = "aa bb cc dd ee ff"
SEQUENCE_IDS = [None, 0, None, 1, 1, 1, None]
WINDOW_1 = [(0, 0), (0, 1), (0, 0), (0, 2), (3, 5), (6, 8), (0, 0)]
WINDOW_2 = [(0, 0), (0, 1), (0, 0), (6, 8), (9, 11), (12, 14), (0, 0)]


def context_only(offsets):
    return [o if s == 1 else None for o, s in zip(offsets, SEQUENCE_IDS)]


def logits(length, **positions):
    """A row of logits: 0 everywhere, the given values at the given token indices (t3=5.0 -> index 3 is 5.0)."""
    row = [0.0] * length
    for name, value in positions.items():
        row[int(name[1:])] = value
    return row


FEATURES = [{"example_id": "q", "offset_mapping": context_only(WINDOW_1)},
            {"example_id": "q", "offset_mapping": context_only(WINDOW_2)}]
EXAMPLES = [{"id": "q", "context": CONTEXT}]
