"""The book's helpers: what the chapters draw, show and check, and nothing they teach.

    viz.py         the ring's steps and the stages' timelines, as figures
    widgets.py     the ring explorer (ipywidgets)
    display.py     tables and source listings in a notebook
    glue.py        values a chapter glues into its prose
    calculator.py  chapter 6's memory calculator
    claims.py      chapter 14's claims, as data and rules
    exercises/     the checkers of the chapters' exercises

The top layer, beside zeronb.bench: may import every layer below (train, zero, the lessons, pool,
runtime); nothing in zeronb imports it.
"""
