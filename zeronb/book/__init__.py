"""The book's helpers: what the chapters draw, show and check, and nothing they teach.

    viz.py         the ring's steps and a collective's timeline, as figures
    timeline.py    a traced ZeRO-3 / FSDP step, unit by unit (chapters 10 and 11)
    widgets.py     the ring explorer (ipywidgets)
    page.py        the calculator and the ring explorer answering in the rendered page, no kernel (calculator.js)
    display.py     tables and source listings in a notebook
    glue.py        values a chapter glues into its prose
    calculator.py  chapter 6's memory calculator
    claims.py      chapter 14's claims, as data and rules; claims_text.py: the sentences that explain them
    watched.py     one rank's watched ZeRO-3 step, for chapter 14's memory-over-time figure
    implementations.py  zeronb's, PyTorch's and DeepSpeed's stages side by side (chapters 8-11, 14)
    exercises/     the checkers of the chapters' exercises

The top layer, beside zeronb.bench: may import every layer below (train, zero, the lessons, pool,
runtime); nothing in zeronb imports it (the package's root names its exercises in the list of
modules the ranks' helper process imports ahead).
"""
