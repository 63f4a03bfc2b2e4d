"""Sphinx configuration of the rendered course (``./course book``; labkit/course/book.py).

The source folder is ``build/book-src``, which labkit.course.book fills with the executed
learners' notebooks and the front page; this folder holds only the configuration.
"""

project = "LLM GPU Lab"
author = "LLM GPU Lab"
copyright = "LLM GPU Lab contributors, Apache-2.0"

extensions = ["myst_nb"]
root_doc = "index"

# The notebooks arrive executed (by ./course book, or by the test suite in CI): never run them
# again here.
nb_execution_mode = "off"
nb_merge_streams = True  # one block per run of printed lines, as JupyterLab shows them
# A widget cannot render on a static page; each one the course displays also carries HTML (the
# quiz: questions, choices, answers folded) or text. Dropping the widget view from the html
# builder's priorities picks that, and loads no widget script from a CDN.
nb_mime_priority_overrides = [
    ("html", "application/vnd.jupyter.widget-view+json", None),
    ("dirhtml", "application/vnd.jupyter.widget-view+json", None),
]
nb_ipywidgets_js = {}
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3  # the notebooks link to their own sections: [..](#a-heading)

html_theme = "sphinx_book_theme"
html_title = "LLM GPU Lab"
html_copy_source = False  # no second copy of every notebook, images and all, in _sources/
html_show_sourcelink = False
html_theme_options = {
    "use_download_button": False,
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "secondary_sidebar_items": {"index": []},  # the front page's table needs the width
}
html_static_path = ["_static"]
html_css_files = ["book.css"]
# Notebook markdown skips heading levels and links files of the repository the site does not
# hold: neither is worth a warning per page.
suppress_warnings = ["myst.header", "myst.xref_missing"]
