"""Writes instructions.jsonl: the seed instructions that the target answers for self-distillation.

Hand-written templates x topics, passages and sentences (written for specref; nothing here is
taken from Spec-Bench or any other evaluation set). Deterministic: `python make_instructions.py`
rewrites the same file. Each line: {"id": int, "category": str, "instruction": str}.
"""
import json
import random
from pathlib import Path

PASSAGES = [
    ("A small town in northern Norway has started heating its swimming pool with waste heat from a "
     "nearby data centre. The project, which took two years to plan, pipes warm water through an "
     "underground loop. Officials say the pool's energy bill fell by almost half in the first winter, "
     "and the data centre no longer needs to run its cooling towers at full power.", "the pool"),
    ("The honeybee dance is a way for foragers to tell other bees where food is. A bee that has found "
     "flowers returns to the hive and walks in a figure-eight pattern. The angle of the straight part "
     "of the dance shows the direction of the food relative to the sun, and the length of the waggle "
     "shows how far away it is.", "the dance"),
    ("Last Tuesday the city council voted seven to two to turn the old railway line into a cycling "
     "path. The path will run for eleven kilometres and connect three neighbourhoods with the city "
     "centre. Construction is expected to begin next spring and to cost about four million euros, "
     "most of which will come from a national transport fund.", "the path"),
    ("Sourdough bread is made with a starter, a mixture of flour and water in which wild yeast and "
     "lactic acid bacteria grow. The bacteria produce acids that give the bread its sour taste, while "
     "the yeast produces the gas that makes it rise. Because the process is slow, a loaf can take more "
     "than a day to make.", "sourdough"),
    ("The company reported revenue of 82 million dollars for the third quarter, up 12 percent from a "
     "year earlier. Profit fell slightly because of higher shipping costs. The chief executive said "
     "demand for the new line of kitchen appliances was stronger than expected and that two new "
     "factories would open in 2026.", "the company"),
    ("Glaciers in the Alps have lost more than a third of their volume since the year 2000. Scientists "
     "measure the loss with stakes drilled into the ice and with satellite images. Warmer summers melt "
     "the ice faster than winter snow can replace it, and some small glaciers have already "
     "disappeared completely.", "the glaciers"),
    ("Maria Lopez, a retired teacher from Valencia, has walked the length of Spain's coast over four "
     "summers. She carried a small backpack, slept in hostels and kept a diary of the people she met. "
     "Her book about the journey, published in March, has become a surprise bestseller.", "Maria"),
    ("The museum's new exhibition brings together 140 maps made between the 15th and 19th centuries. "
     "Visitors can see how ideas about the shape of the continents changed as sailors returned with "
     "new information. A highlight is a hand-painted world map from 1570 that shows a huge southern "
     "continent that does not exist.", "the exhibition"),
    ("Octopuses have three hearts and blue blood. Two of the hearts pump blood through the gills, "
     "while the third pumps it through the rest of the body. Their blood contains a copper-based "
     "protein called hemocyanin, which carries oxygen well in cold water with little oxygen.",
     "octopuses"),
    ("A study of 3,000 office workers found that those who took a short walk every hour reported "
     "less back pain and better concentration than those who stayed at their desks. The researchers "
     "suggest that employers encourage regular breaks, but they note that the study relied on the "
     "workers' own reports rather than medical tests.", "the study"),
    ("The volunteer fire brigade of the village was founded in 1923 with a single hand-pulled pump. "
     "Today it has twenty-eight members, two trucks and a small boat for floods. Last year the "
     "brigade answered 64 calls, most of them storms and traffic accidents rather than fires.",
     "the brigade"),
    ("Solar panels work by turning sunlight into electricity using layers of silicon. When light hits "
     "the silicon, it knocks electrons loose, and the panel's wiring collects them as an electric "
     "current. Panels produce less power on cloudy days and none at night, so many homes pair them "
     "with batteries.", "solar panels"),
    ("The football club announced on Friday that its long-time coach will step down at the end of "
     "the season. In nine years he led the team to two league titles and a cup final. The club said "
     "it would name a successor before the summer transfer window opens.", "the coach"),
    ("Tea was first drunk in China, where, according to legend, leaves fell into an emperor's pot of "
     "boiling water. It spread to Japan with Buddhist monks and reached Europe in the 17th century "
     "through Dutch and Portuguese traders. In Britain it became so popular that a tax on it helped "
     "fund the government.", "tea"),
    ("A new app lets hikers report the condition of mountain trails in real time. Users can mark "
     "fallen trees, washed-out bridges or snow, and the reports appear on a shared map. The park "
     "service says the app has helped rangers fix problems faster, though it warns that reports are "
     "not always accurate.", "the app"),
    ("The city library will stay open until midnight during the exam period in June. Students can "
     "book study rooms online up to a week in advance, and the café on the ground floor will serve "
     "free coffee after ten in the evening. The extended hours are a trial and may become permanent "
     "if enough people use them.", "the library"),
    ("Koalas sleep up to twenty hours a day. Their diet of eucalyptus leaves is low in energy and "
     "hard to digest, so they save energy by resting. Eucalyptus is also toxic to most animals, but "
     "koalas have special bacteria in their gut that break down the poisons.", "koalas"),
    ("The bridge, built in 1891, was closed to cars in 2019 after engineers found cracks in two of "
     "its iron supports. After a three-year repair, it reopened this week for pedestrians and "
     "cyclists only. The town plans to hold a small festival on the bridge every September.",
     "the bridge"),
    ("Researchers have trained a robot arm to fold laundry by watching videos of people doing it. "
     "The robot can now fold towels and t-shirts correctly about 80 percent of the time, but it "
     "still struggles with socks and anything inside out. The team hopes the method will help robots "
     "learn other household tasks.", "the robot"),
    ("The annual winter market opens on the first Saturday of December in the old square. About "
     "sixty stalls sell handmade gifts, hot drinks and local food. This year the organisers have "
     "banned plastic cups, and visitors will pay a small deposit for a ceramic mug they can return "
     "or keep.", "the market"),
    ("Photosynthesis is the process plants use to make food from light. Inside the leaves, chlorophyll "
     "absorbs sunlight and uses its energy to combine carbon dioxide from the air with water from the "
     "soil. The result is sugar, which the plant uses to grow, and oxygen, which it releases.",
     "photosynthesis"),
    ("The airline said on Monday that it would add direct flights between Lisbon and Toronto from "
     "May. The route will run four times a week on a new long-range aircraft that uses about fifteen "
     "percent less fuel than older planes. Tickets go on sale next week.", "the airline"),
    ("An amateur astronomer in Australia discovered a new comet using a telescope in her back yard. "
     "She noticed a faint, fuzzy spot that moved between photographs taken an hour apart. "
     "Professional observatories confirmed the find two days later, and the comet now carries her "
     "name.", "the astronomer"),
    ("The school garden project began with four raised beds and a handful of parents. Three years "
     "later, pupils grow tomatoes, beans and herbs, and the school kitchen uses the harvest in lunches "
     "in early autumn. Teachers say the garden has also become an outdoor classroom for science "
     "lessons.", "the garden"),
]

FOREIGN = {
    "German": [
        "Der Zug nach Hamburg hat heute zwanzig Minuten Verspätung.",
        "Meine Großmutter backt jeden Sonntag einen Apfelkuchen für die ganze Familie.",
        "Im Sommer gehen wir oft am Fluss spazieren und essen danach ein Eis.",
        "Die neue Brücke soll im nächsten Jahr fertig sein, aber die Kosten steigen weiter.",
        "Kannst du mir sagen, wo der nächste Bahnhof ist?",
        "Das Museum ist montags geschlossen und am Wochenende sehr voll.",
        "Wegen des starken Regens wurde das Konzert im Park abgesagt.",
        "Er hat drei Jahre in Wien gelebt und spricht deshalb sehr gut Deutsch.",
        "Die Forscher haben eine neue Art von Käfer im Regenwald entdeckt.",
        "Ich trinke morgens lieber Tee als Kaffee.",
    ],
    "French": [
        "Le marché du samedi matin attire des habitants de tous les villages voisins.",
        "Nous avons réservé une table pour quatre personnes à huit heures.",
        "La bibliothèque municipale prête aussi des outils de jardinage.",
        "Il a neigé toute la nuit et les écoles sont fermées aujourd'hui.",
        "Ma sœur apprend à jouer du violon depuis deux ans.",
        "Le gouvernement a annoncé un nouveau plan pour les transports publics.",
        "Après le dîner, ils ont regardé un vieux film en noir et blanc.",
        "Cette entreprise fabrique des vélos électriques depuis dix ans.",
    ],
    "Spanish": [
        "El autobús pasa cada quince minutos por la plaza mayor.",
        "Mañana vamos a visitar a mis abuelos en el campo.",
        "La tienda de la esquina vende el mejor pan de la ciudad.",
        "El equipo ganó el partido en el último minuto.",
        "Necesito comprar un regalo para el cumpleaños de mi hermano.",
        "Los científicos estudian cómo el calor afecta a los bosques.",
        "En invierno la montaña se llena de esquiadores.",
        "¿Sabes a qué hora abre la farmacia los domingos?",
    ],
}

ENGLISH_SENTENCES = [
    "The weather will be sunny and warm for the rest of the week.",
    "Please close the window before you leave the room.",
    "Our train leaves at half past seven tomorrow morning.",
    "I have been learning to cook since I moved to the city.",
    "The children are playing football in the garden.",
    "Where can I buy a ticket for the museum?",
    "She wrote a letter to her friend who lives abroad.",
    "The shop on the corner closes early on Sundays.",
]

CONCEPTS = ["photosynthesis", "inflation", "gravity", "the water cycle", "machine learning",
            "compound interest", "vaccines", "black holes", "democracy", "the internet",
            "plate tectonics", "supply and demand", "evolution", "climate change", "recursion",
            "electric circuits", "the immune system", "blockchain", "the greenhouse effect",
            "probability", "DNA", "renewable energy", "the stock market", "sleep",
            "encryption", "the moon's phases", "antibiotics", "a budget", "rainbows", "tides"]
AUDIENCES = ["a ten-year-old", "a high school student", "a busy manager", "someone who has never "
             "heard of it", "a university student", "my grandmother"]
WRITING_FORMS = ["a short poem", "a haiku", "a short story", "a blog post introduction",
                 "a product description", "a motivational speech", "a limerick", "a diary entry",
                 "a short news report", "a thank-you note", "a song chorus", "a two-paragraph essay"]
WRITING_TOPICS = ["autumn leaves", "a lost umbrella", "the first day at a new job", "a lighthouse",
                  "a city at night", "learning to swim", "a robot who loves music", "rainy Mondays",
                  "a reusable water bottle", "friendship", "the ocean", "a forgotten garden",
                  "a train journey", "coffee", "moving to a new country", "a mountain village",
                  "a noisy neighbour", "the last day of summer", "a wise old cat", "a bicycle"]
EMAILS = ["ask your manager for a day off next Friday", "invite colleagues to a farewell lunch",
          "complain politely about a late delivery", "thank a teacher for their help",
          "ask a landlord to repair the heating", "apply for a part-time job at a bookshop",
          "remind a team about a deadline", "cancel a dentist appointment",
          "welcome a new member to a running club", "ask a professor for a recommendation letter"]
PERSONAS = [("a pirate captain", "What do you think about modern ships?"),
            ("a medieval knight", "How do you spend a normal day?"),
            ("a famous chef", "What is the secret of a good soup?"),
            ("a travel guide in Rome", "What should I see in one day?"),
            ("a friendly robot from the future", "What is life like in your time?"),
            ("a detective", "How do you solve a difficult case?"),
            ("an astronaut on the space station", "What do you miss most about Earth?"),
            ("a grumpy librarian", "Can I bring my lunch into the reading room?"),
            ("a football coach at half-time", "We are losing 2-0. What do we do?"),
            ("a wise old tree", "What have you seen in your life?"),
            ("a personal fitness trainer", "How do I start running?"),
            ("a tour guide at a chocolate factory", "How is chocolate made?")]
LANGS = ["Python", "JavaScript", "Java", "C", "Rust", "Go", "SQL", "Bash"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "counts the vowels in a string",
              "returns the largest element of a list", "computes the factorial of a number",
              "removes duplicates from a list", "checks whether a word is a palindrome",
              "merges two sorted lists", "converts Celsius to Fahrenheit",
              "finds the second smallest number in an array", "sums the digits of an integer",
              "sorts a list of words by length", "counts how often each word appears in a text",
              "implements binary search", "checks whether two strings are anagrams",
              "computes the greatest common divisor of two numbers", "flattens a nested list",
              "validates an email address with a simple rule"]
CODE_QUESTIONS = ["What is the difference between a list and a tuple in Python?",
                  "Explain what a hash table is and when to use one.",
                  "What does the `git rebase` command do?",
                  "Explain the difference between a process and a thread.",
                  "What is Big-O notation? Give three examples.",
                  "What is the difference between SQL JOIN types?",
                  "Explain what an API is with a simple example.",
                  "What is a race condition and how can it be avoided?",
                  "How does garbage collection work in Java?",
                  "What are the advantages of unit tests?"]
QA = ["What is the capital of Canada?", "Who painted the Mona Lisa?", "How many legs does a spider have?",
      "What is the largest planet in the solar system?", "Who wrote Pride and Prejudice?",
      "In which country is the city of Kyoto?", "What gas do plants absorb from the air?",
      "How many continents are there?", "What is the boiling point of water at sea level?",
      "Who was the first person to walk on the moon?", "What is the longest river in Africa?",
      "Which element has the chemical symbol O?", "What language is spoken in Brazil?",
      "When did the Second World War end?", "What is the smallest prime number?",
      "Who invented the telephone?", "What is the currency of Japan?",
      "Which ocean lies between Europe and North America?", "What is the hardest natural material?",
      "How many days are there in a leap year?", "Who composed the Fifth Symphony?",
      "What is the tallest mountain in the world?", "What do bees make?",
      "Which planet is known as the red planet?", "What is the freezing point of water in Fahrenheit?",
      "Who discovered penicillin?", "What is the capital city of Australia?",
      "How many players are on a football team on the field?", "What is the main ingredient of guacamole?",
      "Which country is famous for the maple leaf flag?", "What instrument has 88 keys?",
      "Who wrote the play Romeo and Juliet?", "What is the largest desert in the world?",
      "Which animal is the largest mammal?", "What year did the Berlin Wall fall?",
      "What is the square root of 81?", "Which organ pumps blood through the body?",
      "Where are the pyramids of Giza?", "What is the chemical formula of table salt?",
      "Who developed the theory of relativity?"]
OPEN_QUESTIONS = ["What are some tips for a good night's sleep?", "How can I save money on groceries?",
                  "What are the pros and cons of working from home?", "How do I prepare for a job interview?",
                  "Why is reading books important?", "What should I pack for a weekend camping trip?",
                  "How can a city reduce traffic?", "What makes a good leader?",
                  "How can I learn a new language quickly?", "What are healthy breakfast ideas?",
                  "Why do people enjoy music?", "How can schools reduce bullying?",
                  "What is the meaning of happiness?", "Is it better to rent or to buy a home?",
                  "How has social media changed friendship?", "What can I do to reduce stress?",
                  "Why do we have seasons?", "How do airplanes stay in the air?",
                  "What causes earthquakes?", "Why is the sky blue?"]
NAMES = ["Anna", "Tom", "Lena", "Omar", "Priya", "Jack", "Sofia", "Ken", "Maya", "Luis"]
ITEMS = [("apples", 2), ("notebooks", 3), ("pencils", 1), ("cupcakes", 4), ("tickets", 12),
         ("plants", 7), ("books", 9), ("shirts", 15)]


def math_problems(rng):
    out = []
    for i in range(60):
        n, (item, price) = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(3, 40), rng.randint(2, 9), rng.randint(10, 200)
        kind = i % 6
        if kind == 0:
            q = (f"{n} buys {a} {item} at {price} dollars each and pays with a {((a * price) // 50 + 1) * 50}"
                 f" dollar note. How much change does {n} get?")
        elif kind == 1:
            q = (f"A bakery makes {c} loaves a day and sells {b} loaves every hour for {a % 10 + 3} hours. "
                 f"How many loaves are left at the end of the day?")
        elif kind == 2:
            q = f"{n} reads {b} pages every day. How many days will it take to finish a {c * 3}-page book?"
        elif kind == 3:
            q = f"A train travels {c} kilometres in {b} hours. What is its average speed?"
        elif kind == 4:
            q = f"Solve for x: {b}x + {a} = {b * rng.randint(2, 12) + a}."
        else:
            q = (f"{n} has {c} dollars, spends a quarter of it on {item} and half of the rest on food. "
                 f"How much money is left?")
        out.append(("math", q + rng.choice(["", " Explain your steps.", " Show your work."])))
    for x, y in [(17, 23), (144, 12), (3.5, 4), (250, 0.2), (1024, 32), (45, 45), (999, 3), (68, 7)]:
        out.append(("math", rng.choice([f"What is {x} times {y}?", f"Compute {x} divided by {y}.",
                                        f"What is {x} plus {y}, multiplied by 2?"])))
    for shape, dims in [("rectangle", "8 cm by 5 cm"), ("circle", "radius 3 m"), ("triangle", "base 10 and height 4"),
                        ("square", "side 7 inches"), ("cube", "edge 4 cm")]:
        out.append(("math", f"What is the area (or volume) of a {shape} with {dims}?"))
    return out


def main():
    rng = random.Random(0)
    items = []
    for c in CONCEPTS:
        items.append(("explain", f"Explain {c} to {rng.choice(AUDIENCES)}."))
    for c in rng.sample(CONCEPTS, 12):
        items.append(("explain", f"What is {c}? Answer in one paragraph."))
    for f in WRITING_FORMS:
        for t in rng.sample(WRITING_TOPICS, 4):
            items.append(("writing", f"Write {f} about {t}."))
    for e in EMAILS:
        items.append(("writing", f"Write a short email to {e}."))
    for persona, q in PERSONAS:
        items.append(("roleplay", f"Pretend you are {persona}. {q}"))
        items.append(("roleplay", f"You are {persona}. Stay in character and answer: {q}"))
    for lang in LANGS:
        for t in rng.sample(CODE_TASKS, 4):
            items.append(("coding", f"Write a {lang} function that {t}."))
    items += [("coding", q) for q in CODE_QUESTIONS]
    items += [("coding", f"Fix the bug in this Python code and explain the fix:\n\n{snip}") for snip in (
        "def average(xs):\n    return sum(xs) / len(xs) + 1",
        "for i in range(10)\n    print(i)",
        "def is_even(n):\n    return n % 2 == 1",
        "items = [1, 2, 3]\nprint(items[3])")]
    items += math_problems(rng)
    items += [("reasoning", q) for q in (
        "If all roses are flowers and some flowers fade quickly, can we say that some roses fade quickly?",
        "Tom is taller than Sara, and Sara is taller than Ben. Who is the shortest?",
        "A farmer has 17 sheep. All but 9 run away. How many are left?",
        "If it takes 5 machines 5 minutes to make 5 widgets, how long do 100 machines take to make 100 widgets?",
        "Which is heavier, a kilogram of feathers or a kilogram of iron?",
        "Three friends share a pizza cut into 8 slices. If each eats 2 slices, how many are left?",
        "I am thinking of a number. If I double it and add 6 I get 20. What is the number?",
        "A clock shows 3:15. What is the angle between the hour and minute hands?",
        "You have two coins that add up to 30 cents and one of them is not a nickel. What are they?",
        "If today is Wednesday, what day will it be in 10 days?")]
    for q in QA:
        items.append(("qa", q))
    for q in OPEN_QUESTIONS:
        items.append(("qa", q))
    for text, subject in PASSAGES:
        items.append(("summarization", f"Summarize the following text in two sentences:\n\n{text}"))
        items.append(("summarization", f"Summarize: {text}"))
        items.append(("summarization", f"Give a one-sentence headline for this article:\n\n{text}"))
        items.append(("extraction", f"List every number mentioned in this text and what it refers to:\n\n{text}"))
        items.append(("rag", f"{text}\n\nBased on the passage above, what is the main point about {subject}?"))
        items.append(("rag", f"Read the passage and answer the question.\n\nPassage: {text}\n\n"
                             f"Question: What does the passage say about {subject}?"))
    for lang, sents in FOREIGN.items():
        for s in sents:
            items.append(("translation", f"Translate {lang} to English: {s}"))
            items.append(("translation", f"What does this {lang} sentence mean in English? \"{s}\""))
    for s in ENGLISH_SENTENCES:
        for lang in ("French", "German", "Spanish"):
            items.append(("translation", f"Translate into {lang}: {s}"))
    rng.shuffle(items)
    path = Path(__file__).with_name("instructions.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i, (cat, text) in enumerate(items):
            f.write(json.dumps({"id": i, "category": cat, "instruction": text}, ensure_ascii=False) + "\n")
    print(f"wrote {len(items)} instructions to {path}")


if __name__ == "__main__":
    main()
