"""Chat prompts for distillation: instruction templates x topics, with a disjoint held-out split.

The held-out prompts (benchmarks, acceptance checks) use topics *and* templates that never appear in
the training prompts, so acceptance measured on them is not inflated by memorised continuations.
"""
from __future__ import annotations

import random

TEMPLATES = [
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "What are the main benefits and drawbacks of {t}?",
    "Give me three interesting facts about {t}.",
    "How would you describe {t} to a ten-year-old?",
    "Write a haiku about {t}.",
    "List five key ideas related to {t}.",
    "What is the history of {t}?",
    "Write a short story that involves {t}.",
    "Why is {t} important?",
    "Compare {t} with something similar and explain the differences.",
    "Give a step-by-step guide to getting started with {t}.",
    "What are common misconceptions about {t}?",
    "Summarize what experts say about {t} in a few sentences.",
    "Write an email to a friend recommending {t}.",
    "What questions should a beginner ask about {t}?",
    "Describe a typical day for someone who works with {t}.",
    "Write a persuasive argument in favour of {t}.",
    "What are the ethical considerations around {t}?",
    "Create a quiz with three questions about {t}.",
    "Tell me a fun fact about {t}.",
    "How has {t} changed over the last fifty years?",
    "What skills are needed to understand {t}?",
    "Write a product description for something related to {t}.",
    "Explain the role of {t} in everyday life.",
    "Write a limerick about {t}.",
    "What would the world look like without {t}?",
    "Give advice to someone who is nervous about {t}.",
    "Write a tweet about {t}.",
    "Explain {t} using an analogy.",
    "What are the pros and cons of {t}? Answer in a table.",
    "Write a dialogue between a teacher and a student about {t}.",
    "Summarize {t} in one sentence.",
    "What is a surprising fact about {t}?",
    "Write a short blog post introduction about {t}.",
    "Give me a beginner's checklist for {t}.",
    "How does {t} work?",
    "Write a motivational message inspired by {t}.",
    "What are the biggest open questions about {t}?",
    "Explain {t} to someone from the year 1800.",
    "Write a riddle whose answer is {t}.",
    "What careers are related to {t}?",
    "Outline a five-minute presentation on {t}.",
    "Write a short news headline and lead paragraph about {t}.",
    "Give three tips for learning about {t}.",
    "What are the most common mistakes people make with {t}?",
    "Describe {t} in the style of a nature documentary.",
    "Write a thank-you note to the inventor of {t}.",
]
HELD_OUT_TEMPLATES = [
    "Can you teach me the basics of {t}?",
    "Write two sentences about {t}.",
    "What should everyone know about {t}?",
    "Describe {t} briefly.",
]
TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "climate change",
    "the stock market", "vaccines", "the Roman Empire", "renewable energy", "the human heart",
    "volcanoes", "the internet", "democracy", "chess", "coffee", "honey bees", "the moon landing",
    "quantum computing", "meditation", "recycling", "electric cars", "the water cycle", "gravity",
    "ancient Egypt", "jazz music", "the immune system", "social media", "cryptography", "rainforests",
    "the printing press", "earthquakes", "nutrition", "public libraries", "space exploration",
    "the Olympic Games", "dinosaurs", "inflation", "sleep", "the ocean", "artificial intelligence",
    "the Renaissance", "bicycles", "solar panels", "DNA", "friendship", "urban gardening", "volunteering",
    "the Great Wall of China", "photography", "mountain climbing", "tea", "programming in Python",
    "databases", "the periodic table", "bridges", "airplanes", "trains", "weather forecasting",
    "the theory of evolution", "pollination", "antibiotics", "the brain", "learning a new language",
    "time management", "budgeting", "cooking pasta", "baking bread", "yoga", "marathon running",
    "video games", "board games", "the violin", "painting", "sculpture", "poetry", "opera",
    "the Industrial Revolution", "World War II", "the Cold War", "the United Nations", "taxes",
    "cloud computing", "open source software", "smartphones", "batteries", "nuclear energy",
    "wind turbines", "electricity", "magnets", "light", "sound waves", "rainbows", "snowflakes",
    "glaciers", "deserts", "coral reefs", "penguins", "elephants", "wolves", "cats", "dogs",
    "mushrooms", "trees", "the Amazon river", "the Sahara", "Mount Everest", "Antarctica",
    "the solar system", "Mars", "comets", "telescopes", "microscopes", "robots", "3D printing",
    "blockchain", "email", "spreadsheets", "recipes", "chocolate", "cheese", "the Silk Road",
    "the Vikings", "pyramids", "castles", "knights", "pirates", "the stock exchange", "banking",
    "insurance", "job interviews", "public speaking", "writing a resume", "teamwork", "leadership",
    "negotiation", "kindness", "happiness", "stress", "exercise", "hydration", "vitamins",
    "first aid", "fire safety", "camping", "fishing", "gardening", "composting", "bird watching",
    "astronomy", "geology", "chemistry", "physics", "mathematics", "statistics", "probability",
    "prime numbers", "fractions", "geometry", "algebra", "calculus", "linear regression",
    "sorting algorithms", "recursion", "operating systems", "computer networks", "encryption",
    "passwords", "compilers", "the Linux kernel", "version control", "unit testing",
    "hiking", "skiing", "surfing", "swimming", "soccer", "basketball", "tennis", "the guitar", "drums",
    "classical music", "hip hop", "movies", "television", "newspapers", "podcasts", "radio", "museums",
    "architecture", "skyscrapers", "roads", "traffic", "public transport", "cities", "villages", "farming",
    "rice", "wheat", "potatoes", "tomatoes", "apples", "bananas", "oranges", "salt", "sugar", "spices",
    "pizza", "sushi", "soup", "breakfast", "restaurants", "tipping", "shopping", "online shopping",
    "advertising", "marketing", "startups", "small businesses", "remote work", "meetings", "email etiquette",
    "parenting", "grandparents", "pets", "horses", "sharks", "whales", "butterflies", "ants", "spiders",
    "frogs", "owls", "eagles", "parrots", "lions", "tigers", "bears", "kangaroos", "koalas", "pandas",
    "clouds", "lightning", "hurricanes", "floods", "droughts", "rivers", "lakes", "islands", "caves",
    "minerals", "diamonds", "gold", "steel", "plastic", "glass", "paper", "cotton", "wool", "fashion",
]
HELD_OUT_TOPICS = [
    "lighthouses", "origami", "the Eiffel Tower", "submarines", "tornadoes", "kites", "the piano",
    "crossword puzzles", "hot air balloons", "octopuses", "the human skeleton", "libraries of code",
]
# hand-written held-out chat prompts in the style of bench/cpu_smollm2.py (none are built from the lists above)
HELD_OUT_EXTRA = [
    "Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate.",
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Translate to French: Good morning, how are you today?",
]


def training_prompts(num: int, seed: int = 0) -> list[str]:
    """`num` distinct training prompts (cycling when num exceeds the combinations)."""
    combos = [tpl.format(t=topic) for tpl in TEMPLATES for topic in TOPICS]
    random.Random(seed).shuffle(combos)
    return [combos[i % len(combos)] for i in range(num)]


def held_out_prompts() -> list[str]:
    built = [tpl.format(t=topic) for topic, tpl in zip(HELD_OUT_TOPICS, HELD_OUT_TEMPLATES * 3)]
    return built + HELD_OUT_EXTRA
