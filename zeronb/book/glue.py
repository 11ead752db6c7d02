"""Hand a value measured in a chapter to the book's prose: myst-nb's `glue`, where it is installed.

The rendered book writes numbers into its sentences with {glue:text}`name` roles, filled from
values the notebook glued. A chapter opened on its own (Colab, JupyterLab on a GPU box) has no
myst-nb and needs none: there `glue` shows the value where `display=True` and otherwise does
nothing, and the chapter runs the same.
"""
try:
    from myst_nb import glue as _myst_glue
except ImportError:  # not building the book
    _myst_glue = None


def glue(name: str, variable, display: bool = True) -> None:
    """Store `variable` under `name` for the book's prose (and show it, if `display`)."""
    if _myst_glue is not None:
        _myst_glue(name, variable, display=display)
    elif display:
        from IPython.display import display as show

        show(variable)
