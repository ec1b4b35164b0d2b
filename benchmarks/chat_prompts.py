"""Chat prompts in an assistant benchmark's shape for the drafter's training data: one-sentence open
questions and requests -- advice, explanations, two-part knowledge questions, comparisons, role-play,
estimates, what-ifs, short writing tasks -- each a template of this file filled with a topic of
this file.

The drafter's self-written chat prompts are what SmolLM2 writes when asked for a question: short and
alike, and they stopped paying on vicuna-bench (measured 2026-12-05). The questions people put
to an assistant vary in kind and audience; this file writes them from ~55 templates over ~400
hand-written topics, shuffled with a seed. No template is a judged prompt's wording, and the data
stage refuses the judged files' prompts all the same. No topic is a judged chat prompt's subject
either: the 43 that were or came near (natural selection, vaccines, critical thinking, Python
against JavaScript, ...) were taken out on 2026-12-05, after two data files had trained the drafter on them;
tests/test_shaped_prompts.py checks every topic against
vicuna-bench.

    python benchmarks/chat_prompts.py --out runs/chat-open.jsonl [--limit 2500] [--seed 0]
    ddtree train-drafter --workdir W --stage data --prompts runs/chat-open.jsonl ...
"""

from __future__ import annotations

import argparse
import random

from ddtree.bench import write_prompts


def topics(text: str) -> list[str]:
    """A comma-separated, line-wrapped list of topics as clean strings."""
    return [" ".join(t.split()) for t in text.split(",")]


SKILLS = topics("""public speaking, cooking, writing, drawing, negotiating, chess, photography,
gardening, swimming, running long distances, learning languages, playing the guitar, coding, budgeting,
sleeping well, listening, leading a team, giving feedback, taking notes, memorizing facts, reading
faster, making decisions, solving puzzles, typing, baking bread, managing money, job interviews,
networking, teaching children, staying focused, writing emails, mental math, knitting, singing, dancing,
driving in snow, saving energy at home, repairing a bicycle""")

GOALS = topics("""save money on groceries, get more exercise, make new friends in a new city, stay
motivated while studying, reduce screen time, prepare for a marathon, eat more vegetables, keep a house
plant alive, learn to cook on a budget, travel with less luggage, get organized at work, wake up earlier,
read more books, reduce food waste, recover from burnout, keep a journal, prepare for an exam, move to
another country, care for an elderly parent, train a puppy, pay off debt, cut down on sugar, write a
novel, stay safe while hiking, plan a wedding, reduce noise in an apartment, make a long flight
comfortable, help a child with homework, lower an electricity bill, be more patient, handle criticism,
keep in touch with old friends, make a garden attract bees, choose a laptop, start running at fifty,
learn to swim as an adult, host a dinner party, keep a tidy home, plan a holiday on a small budget, start
volunteering, cook for a large family, get back into reading, improve my handwriting, sleep on a night
train, grow tomatoes on a balcony, teach a teenager to drive, prepare a house for winter, choose a first
bicycle, run a book club, get ready for a long hike, learn to touch type, settle into a new school, keep
a long-distance friendship going, look after a rescue cat, plan a child's birthday party""")

FIELDS = topics("""urban planning, storing renewable energy, container shipping, the human microbiome,
earthquake-resistant buildings, desalination, weather forecasting, organ donation, carbon capture, the
electric grid, fusion research, self-driving cars, houses built by 3D printers, nuclear power, online
privacy, password security, cloud computing, open-source software, satellites that watch the Earth, sleep
research, memory in old age, public libraries, sports science, wildlife corridors, river restoration,
melting glaciers, volcano monitoring, tsunami warning systems, air traffic control, credit unions,
microloans, a universal basic income, minimum wage laws, rent control, a four-day working week, ageing
populations, pension systems, noise-cancelling headphones, smart thermostats, archaeology, weather
satellites, dam building, bird migration, space telescopes, seed banks""")

PAIRS = [("a lake", "a sea"), ("weather", "climate"), ("a virus", "a bacterium"), ("stocks", "bonds"),
         ("renting", "buying a home"), ("a crocodile", "an alligator"), ("baking soda", "baking powder"),
         ("a democracy", "a republic"), ("an electric car", "a hybrid car"), ("tea", "coffee"),
         ("speed", "velocity"), ("a comet", "an asteroid"), ("a psychologist", "a psychiatrist"),
         ("weightlifting", "yoga"), ("a novel", "a short story"), ("an LED bulb", "an incandescent bulb"),
         ("a credit card", "a debit card"), ("mitosis", "meiosis"), ("a violin", "a viola"), ("frogs", "toads"),
         ("a hurricane", "a tornado"), ("wool", "cotton"), ("nuclear fission", "nuclear fusion"),
         ("a city", "a town"), ("trains", "planes for short trips"), ("a hotel", "a hostel"),
         ("cats", "dogs as pets"), ("a laptop", "a desktop computer"), ("butter", "margarine"),
         ("an ocean current", "a tide"), ("a loan", "a lease"), ("a museum", "a gallery"),
         ("a sprint", "a marathon"), ("a pencil", "a pen for sketching")]

CONCEPTS = topics("""photosynthesis, inflation, compound interest, the water cycle, supply and demand,
black holes, the greenhouse effect, plate tectonics, machine learning, the immune system, gravity,
electricity, the stock market, opportunity cost, the placebo effect, recycling, democracy, blockchain,
the scientific method, entropy, DNA, antibiotics, interest rates, sleep cycles, tides, rainbows, the
seasons, carbon dating, encryption, the metric system, probability, a budget deficit, the food chain,
muscle memory, jet lag, echoes, volcanoes, earthquakes, the northern lights, ocean acidification,
copyright, solar panels, wind turbines, the printing press, the Roman Empire, the Silk Road, the
Industrial Revolution, the moon landing, the French Revolution, ancient Egypt's pyramids, the Great Wall
of China, the invention of the telephone, the history of money""")

SYSTEMS = topics("""a refrigerator, a bicycle's gears, a search engine, a credit score, a heat pump, a
GPS receiver, a microwave oven, a jet engine, a camera lens, a 3D printer, a dishwasher, a battery, the
human heart, the kidneys, a thermostat, a touch screen, a compass, an elevator, a lock and key, a washing
machine, a hearing aid, a traffic light system, an online auction, a library catalogue, a postal system,
a water treatment plant, a hydroelectric dam, a sailboat, a submarine, an election, a jury, a central
bank, a recycling plant, a beehive, an ant colony, a coral reef, a rain forest, a desert ecosystem""")

ROLES = [("a ship's captain in a storm", "keep your crew calm"),
         ("a museum guide", "describe your favourite painting"),
         ("a chef opening a new restaurant", "choose the menu"), ("a park ranger", "welcome a group of hikers"),
         ("an astronaut on the space station", "describe a normal day"),
         ("a detective", "explain how you solved a case"),
         ("a medieval blacksmith", "describe your work to a visitor"),
         ("a teacher on the first day of school", "greet your class"),
         ("a tour guide in Rome", "introduce the city"), ("a coach at half-time", "encourage a losing team"),
         ("a librarian", "recommend a book to a bored teenager"), ("a farmer", "explain your year to a city child"),
         ("a radio host", "open the morning show"),
         ("a scientist who found a new species", "present it to the press"),
         ("a travel agent", "sell a holiday in Iceland"), ("a zookeeper", "explain how you care for elephants"),
         ("a mayor", "announce a new park"), ("a lighthouse keeper", "describe a long winter"),
         ("a nurse on a night shift", "describe what you see")]

ESTIMATES = topics("""words a person speaks in a lifetime, grains of sand on a beach, heartbeats in a
day, leaves on a large oak tree, times a person blinks in a year, steps a postal worker walks in a month,
photos taken in the world each day, litres of water a family uses in a week, piano tuners in a large
city, cups of coffee drunk in a country each morning, trees in a city park, breaths a person takes in a
year, kilometres a car drives in its life, songs a radio station plays in a year, bricks in a house,
hairs on a human head, meals a person eats in a lifetime, balls used in a tennis season, letters in a
thick novel""")

WHAT_IFS = topics("""humans could breathe under water, the Moon did not exist, electricity had been
discovered a thousand years earlier, nobody had invented the wheel, everyone spoke the same language, the
dinosaurs had not died out, people lived to two hundred, there were no seasons, the Earth had two suns,
nobody needed to sleep, money did not exist, the Titanic had not sunk, every day were the same length all
year, animals could talk, cities had no cars""")

WRITING = [("a short story", "a lost key"), ("a poem", "the first snow of winter"),
           ("a thank-you note", "a neighbour who helped you move"), ("a speech", "the value of volunteering"),
           ("a short story", "a robot who wants to paint"), ("a poem", "an old bridge"),
           ("a short essay", "why libraries matter"), ("an email to a manager", "asking for a day off"),
           ("a cover letter", "a job at a bookshop"), ("a limerick", "a cat who loves boxes"),
           ("a short story", "two strangers on a delayed train"),
           ("a motivational message", "students before exams"), ("a recipe introduction", "a grandmother's soup"),
           ("a news report", "a town festival"), ("a complaint letter", "a late delivery"),
           ("a toast", "a friend's birthday"), ("a short story", "a village where it never rains"),
           ("a poem", "the sound of the ocean"), ("a short dialogue", "a customer and a baker")]

ISSUES = topics("""air pollution, traffic congestion, loneliness among older people, youth unemployment,
rising housing costs, noise in cities, water scarcity, food waste, deforestation, antibiotic resistance,
childhood obesity, cyberbullying, overfishing, light pollution, soil erosion, homelessness, low voter
turnout, the digital divide, invasive species, heat in crowded cities, fast fashion, electronic waste,
burnout at work, student debt, coral bleaching, species extinction, drought, wildfires, flooding in
coastal towns, the decline of bees, road accidents, sleep loss among teenagers, poor indoor air, litter
in parks, long hospital waiting times, the cost of childcare, desertification, space debris""")

HISTORY = topics("""the fall of the Berlin Wall, the steam engine, the first modern Olympic Games, the
building of the Panama Canal, the end of the Cold War, the first powered flight, the discovery of
penicillin, the Apollo programme, the Great Depression, the electric light bulb, the rise of the Mongol
Empire, the voyages of the Polynesian navigators, the railways of the 1800s, the founding of the United
Nations, the Meiji Restoration in Japan, the California Gold Rush, the fall of Constantinople, the first
farming villages, the Space Race, the first transatlantic telegraph cable, the World Wide Web, the
Protestant Reformation, the Irish potato famine, the exploration of Antarctica, the Magna Carta, the
Library of Alexandria, the invention of the compass""")

AUDIENCES = ["a retired person", "a busy parent", "a complete beginner", "someone on a tight budget",
              "someone who works night shifts"]

LISTENERS = ["my grandmother", "a high-school student"]

TEMPLATES = {
    "advice": [("How do I get better at {}?", SKILLS), ("What are some practical ways to {}?", GOALS),
               ("What mistakes do beginners make when they try to {}?", GOALS),
               ("Can you give me a step-by-step plan to {}?", GOALS),
               ("I want to improve at {}. Where should I start?", SKILLS),
               ("What habits help people become good at {}?", SKILLS),
               ("What should I know before I try to {}?", GOALS),
               ("My friend wants to {}. What advice would you give?", GOALS),
               ("As {}, how can I {}?", [(who, goal) for who in AUDIENCES for goal in GOALS]),
               ("Give me five tips to {}, with a sentence on why each one works.", GOALS),
               ("What daily routine would help someone {}?", GOALS),
               ("What exercises would help me build my {} skills?", SKILLS),
               ("Write a short guide for {} who wants to {}.", [(who, goal) for who in AUDIENCES for goal in GOALS])],
    "issues": [("What are the main causes of {}, and what can be done about it?", ISSUES),
               ("How could a city government reduce {}?", ISSUES), ("What can one person do about {}?", ISSUES),
               ("Which factors shape {} the most, and how do they interact?", ISSUES),
               ("How does {} affect people's health and their communities, and what would reduce the harm?", ISSUES),
               ("What are the economic and social effects of {}, and who bears most of them?", ISSUES)],
    "history": [("What led to {}, and what followed from it?", HISTORY),
                ("How did {} change people's everyday lives?", HISTORY), ("Why do historians still study {}?", HISTORY),
                ("Tell me about {}: what happened, and how does it still shape the world today?", HISTORY)],
    "compare": [("What is the difference between {} and {}?", PAIRS),
                ("Compare {} and {}: what are the advantages of each?", PAIRS),
                ("How are {} and {} alike, and how are they different?", PAIRS),
                ("Which would you recommend, {} or {}, and in what situations?", PAIRS)],
    "explain": [("Explain {} in simple terms.", CONCEPTS), ("Why does {} matter to ordinary people?", CONCEPTS),
                ("Can you explain {} to a ten-year-old?", CONCEPTS), ("How does {} work?", SYSTEMS),
                ("What would go wrong without {}?", SYSTEMS),
                ("What are the most common misconceptions about {}?", CONCEPTS),
                ("What are the key facts everyone should know about {}?", CONCEPTS),
                ("What are the main parts of {}, and what does each one do?", SYSTEMS),
                ("Explain {} as if I were {}.", [(concept, who) for who in LISTENERS for concept in CONCEPTS])],
    "knowledge": [("Describe how {} works, and discuss both its benefits and its risks.", CONCEPTS),
                  ("What role does {} play in modern society, and how might that change in the next twenty years?",
                   CONCEPTS),
                  ("How do scientists and experts study {}, and what have they learned about it so far?", CONCEPTS),
                  ("Walk me through how {} works, from start to finish, and what can go wrong along the way.",
                   SYSTEMS),
                  ("Describe how {} works, and discuss both its benefits and its risks.", FIELDS),
                  ("What role does {} play in modern society, and how might that change in the next twenty years?",
                   FIELDS),
                  ("How do scientists and experts study {}, and what have they learned about it so far?", FIELDS),
                  ("What are the biggest open questions about {}, and why are they hard to answer?", FIELDS),
                  ("Why does {} matter to ordinary people?", FIELDS), ("Explain {} in simple terms.", FIELDS)],
    "roleplay": [("Pretend you are {}. How would you {}?", ROLES), ("You are {}. In a few paragraphs, {}.", ROLES)],
    "estimate": [("Roughly how many {} are there? Walk me through your reasoning.", ESTIMATES),
                 ("Estimate the number of {}, and explain each step of your estimate.", ESTIMATES),
                 ("Give a rough estimate of the number of {}, stating every assumption you make.", ESTIMATES)],
    "what-if": [("What would the world look like if {}?", WHAT_IFS), ("Imagine {}. How would daily life change?", WHAT_IFS),
                ("Suppose {}. What would be the biggest consequences?", WHAT_IFS),
                ("What would be different about today's world if {}?", WHAT_IFS)],
    "writing": [("Write {} about {}.", WRITING), ("Please draft {} about {}, in a warm tone.", WRITING)],
}


def prompts() -> list[str]:
    """Every prompt the templates make, in a fixed order."""
    out = []
    for kinds in TEMPLATES.values():
        for template, topics in kinds:
            for topic in topics:
                out.append(template.format(*(topic if isinstance(topic, tuple) else (topic,))))
    return list(dict.fromkeys(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSONL to write ({\"prompt\": question} rows)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many prompts (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    found = prompts()
    random.Random(args.seed).shuffle(found)
    found = found[: args.limit] if args.limit else found
    write_prompts(args.out, found)
    print(f"{len(found)} chat prompts written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
