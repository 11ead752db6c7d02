"""Small fixes to how Jupyter Book 1.x renders this book, found by its browser tests.

- Thebe (live code through Binder) cannot work without internet access, and sphinx-thebe adds its
  inline script twice to every page ("Identifier 'THEBE_JS_URL' has already been declared" in the
  console). The book has no live-code button, so its scripts are left out.
- The theme logs "Got invalid theme mode" when the page's colour mode is empty: give it one.
- The widget embedder (html-manager 1.x) typesets widget labels with MathJax 2's
  `MathJax.Hub.Queue`; the book has MathJax 3, which has no `Hub` ("Cannot read properties of
  undefined (reading 'Queue')"). Whatever object becomes `window.MathJax` gets a `Hub.Queue` that
  asks MathJax 3 to typeset.
"""

MATHJAX2_SHIM = """(function () {
  function addHub(mj) {
    if (mj && typeof mj === "object" && !mj.Hub) {
      mj.Hub = {Queue: function () {
        if (window.MathJax && window.MathJax.typesetPromise) { window.MathJax.typesetPromise(); }
      }};
    }
    return mj;
  }
  var value = addHub(window.MathJax);
  Object.defineProperty(window, "MathJax", {configurable: true,
    get: function () { return value; }, set: function (v) { value = addHub(v); }});
})();"""


def _drop_thebe(app, pagename, templatename, context, doctree):
    def keep(js):
        body = getattr(js, "attributes", {}).get("body", "") or ""
        name = getattr(js, "filename", str(js)) or ""
        return "THEBE_JS_URL" not in body and "sphinx-thebe" not in name

    if not context.get("default_mode"):  # the page template's colour mode: never empty
        context["default_mode"] = "light"
    if "script_files" in context:
        context["script_files"] = [js for js in context["script_files"] if keep(js)]
    if "css_files" in context:
        context["css_files"] = [c for c in context["css_files"] if "sphinx-thebe" not in str(getattr(c, "filename", c))]


def setup(app):
    app.add_js_file(None, body=MATHJAX2_SHIM, priority=1)  # before MathJax and the widgets
    app.connect("html-page-context", _drop_thebe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
