"""Sphinx's settings for the course website (`make site`, docs/site.md). tools/website.py stages the pages it reads (the
chapters with their stored outputs, the guides, the recorded results) and runs Sphinx with this folder as its
configuration directory; nothing here executes a notebook."""

from __future__ import annotations

import json
import os
from pathlib import Path

from docutils import nodes

project = "accel-course"
author = "the accel-course authors"
html_title = "accel-course"
root_doc = "index"
extensions = ["myst_nb"]
exclude_patterns = ["**.ipynb_checkpoints"]
# A `%%writefile` cell holding a shell script is lexed as IPython, fails, and is highlighted leniently instead; a
# chapter may step from a title to a level-3 heading.
suppress_warnings = ["misc.highlighting_failure", "myst.header"]

# MyST-NB: the notebooks as committed, outputs and figures included; never executed.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3  # `[text](page.md#a-heading)` reaches the heading

# MathJax 2 from the jupyter-server-mathjax wheel (tools/website.py copies it into _static/mathjax/): no CDN, so the
# pages render their formulas offline too.
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
mathjax2_config = {
    # MyST-NB marks each page's body tex2jax_ignore and its formulas `math`: typeset those only.
    "tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]], "processEscapes": True,
                "processEnvironments": True, "ignoreClass": "tex2jax_ignore|mathjax_ignore|document",
                "processClass": "tex2jax_process|mathjax_process|math|output_area"},
    # The STIX web fonts that ship with it; and MathJax 2's placeholder font from `local()`, not from its
    # `url('about:blank')`, which Chromium refuses with a console error.
    "HTML-CSS": {"availableFonts": [], "webFont": "STIX-Web", "imageFont": None,
                 "styles": {"@font-face": {"font-family": "MathJax_Blank", "src": "local('MathJax_Blank')"}}},
    "showMathMenu": False,
    "messageStyle": "none",
}

# Jupyter Book's look: chapters in the left sidebar, the page's sections on the right, previous/next at the bottom.
html_theme = "sphinx_book_theme"
html_theme_options = {
    "repository_url": os.environ.get("ACCEL_SITE_REPOSITORY", ""),
    "use_repository_button": bool(os.environ.get("ACCEL_SITE_REPOSITORY")),
    "use_download_button": True,
    "home_page_in_toc": True,
    "show_toc_level": 2,
}
# Light or dark as the reader's system is (the theme's empty default logs a console error).
html_context = {"default_mode": "auto"}
html_favicon = "favicon.svg"  # else every browser asks for /favicon.ico, and its 404 is a console error
html_show_sourcelink = False
html_copy_source = True  # the download button offers each page's source (a chapter's .ipynb)


def _cell_anchors(app, doctree) -> None:
    """Give each code cell its notebook cell id as an HTML id (tools/website.py gives markdown cells theirs), and make
    every cell id a target of its page, so that docs/guides.md's `chapter.ipynb#<cell id>` links resolve and land on
    the cell."""
    docname = app.env.docname
    path = Path(app.env.doc2path(docname))
    if path.suffix != ".ipynb":
        return
    ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
    for node in doctree.findall(nodes.container):
        if node.get("nb_element") == "cell_code" and ids[node["cell_index"]]:
            node["ids"].insert(0, ids[node["cell_index"]])
    anonlabels = app.env.domaindata["std"].setdefault("anonlabels", {})
    for cell_id in filter(None, ids):
        anonlabels[f"{docname}#{cell_id}"] = (docname, cell_id)


def setup(app):
    app.connect("doctree-read", _cell_anchors)
