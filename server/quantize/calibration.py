"""The built-in calibration text (original prose, a mix of registers). The held-out evaluation text in
server/quantize/evaluation.py shares no sentence with it."""

CALIBRATION_TEXT = """\
The old lighthouse stood at the end of a narrow spit of rock, and for most of the year nobody went there \
except the keeper, who rowed across twice a week for supplies. In winter the wind came straight off the sea, \
and the glass of the lamp room rattled in its frame all night long.

To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven grams of dried \
yeast and three hundred and fifty millilitres of warm water. Knead the dough for ten minutes until it is smooth \
and elastic, then leave it to rise in a covered bowl until it has doubled in size. Shape it, let it rise again, \
and bake it in a hot oven for about thirty-five minutes.

Photosynthesis is the process by which green plants use light energy to turn carbon dioxide and water into \
sugar and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, which \
contain the pigment chlorophyll. The sugar feeds the plant, and the oxygen is released into the air.

User: Can you explain what a hash table is?
Assistant: A hash table stores values under keys. A hash function turns each key into an index in an array, \
so looking a value up takes about the same time no matter how many entries there are. When two keys land on \
the same index, the table resolves the collision, for example by keeping a short list at that position.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

The committee met on Tuesday to discuss the budget for the coming year. After a long debate, the members \
agreed to spend more on the public library and on repairs to the bridge, and less on new office furniture. \
The final vote was seven to two, and the mayor said she was pleased with the result.

Mountains are formed when the plates of the earth's crust push against each other. Over millions of years \
the rock is folded and lifted, and rivers and glaciers carve it into valleys and peaks. The highest mountains \
are often the youngest, because erosion has not yet worn them down.

She opened the letter slowly, as if the words inside might escape. It was from her brother, who had been \
travelling in the south for almost a year. He wrote about markets full of spices, trains that were always \
late, and a small village where the children taught him a song he still could not get out of his head.

In economics, inflation is a general rise in prices over time, which means that the same amount of money \
buys fewer goods. Central banks try to keep inflation low and stable, usually by raising or lowering interest \
rates. Higher rates make borrowing more expensive, which tends to slow spending and bring prices under control.

The train left the station a few minutes late, and by the time it reached the coast the sky had cleared. \
Through the window the passengers could see fishing boats drawn up on the sand, a row of white houses with \
blue shutters, and an old stone church on the hill. A child in the next seat counted the boats out loud, \
losing track at twenty and starting again from one.

Good sleep matters more than most people think. Adults need seven to nine hours a night, and going to bed \
and getting up at the same time every day helps the body keep a steady rhythm. Bright screens late in the \
evening, heavy meals and caffeine in the afternoon can all make it harder to fall asleep.

import json

def load_settings(path):
    with open(path) as f:
        data = json.load(f)
    return {key.lower(): value for key, value in data.items()}

Question: Why is the sky blue?
Answer: Sunlight contains every colour. When it passes through the atmosphere, the short blue wavelengths \
are scattered by the gas molecules in the air much more than the longer red ones, so blue light reaches our \
eyes from every direction of the sky. At sunset the light travels through more air, the blue is scattered \
away, and the sky turns orange and red.

The museum's new exhibition tells the story of the city's harbour, from the wooden jetties of the \
seventeenth century to the container cranes of today. Visitors can walk through a reconstructed warehouse, \
listen to recordings of dock workers, and see the model ships that were once used to train young sailors.

Dear Sam, thank you for your letter and for the photographs of the garden. The roses look wonderful this \
year. We are all well here, although the roof still leaks when it rains hard, and your uncle has promised, \
once again, to fix it before the winter. Write soon and tell us when you plan to visit.

A triangle has three sides and three angles, and the angles always add up to one hundred and eighty \
degrees. In a right-angled triangle, the square of the longest side equals the sum of the squares of the \
other two sides. This rule, known as the theorem of Pythagoras, is used every day by builders and engineers.

Volunteers planted more than two thousand trees along the river last spring. The young oaks and willows \
will hold the banks together during floods, give shade to the fish in summer, and, in twenty years or so, \
turn the bare path into a green walk that the whole town can enjoy.
"""
