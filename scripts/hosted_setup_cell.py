# LLM GPU Lab in a hosted notebook (Colab, Kaggle, SageMaker Studio Lab, any Jupyter server):
# run this cell first. It installs labkit into this notebook's kernel with the versions the
# course is tested with (the host's own torch and Jupyter stay as they are), then prints what
# this machine can show. Run again, it only checks. (labkit/course/hosted.py does the work.)
import os
import runpy
import subprocess
import tempfile

REPO = "<this repository>"  # the course's git URL (https://…), or a folder that holds a clone
REF = "main"  # the branch, tag or commit to install

src = REPO if os.path.isdir(REPO) else os.path.join(tempfile.gettempdir(), "llm-gpu-lab")
if not os.path.isdir(os.path.join(src, "labkit")):
    if REPO.startswith("<"):
        raise ValueError("set REPO, the first line after the imports, to the course's git URL")
    subprocess.run(["git", "clone", "-q", "--depth", "1", REPO, src], check=True)
runpy.run_path(os.path.join(src, "labkit", "course", "hosted.py"))["setup"](src, REPO, REF)
