"""The built-in calibration text (original prose, a mix of registers). The held-out evaluation text in
server/quant/evaluation.py shares no sentence with it."""

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
"""
