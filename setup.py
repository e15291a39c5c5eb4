from setuptools import setup, find_packages

setup(
    name="ddipp",
    version="0.1.0",
    description="Train a fastai Learner (v1 or v2) with DistributedDataParallel on every GPU of a host, "
                "from a notebook or a script.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["ddipp", "ddipp.*"]),
    install_requires=[  # what ddipp.core needs; one of the extras below brings the fastai an adapter serves
        "torch==2.14.1",         # the torch this stack is tested on (ddipp.fastai1.compat fixes fastai v1 for it)
        "torchvision==0.29.1",   # the torchvision built for torch 2.14.1
        "fastprogress==1.0.5",   # 1.1.x pulls a web-server stack and imports 10x slower; same bars for fastai v1 and v2
        "cloudpickle>=3",        # ships notebook-defined functions and classes to the workers
    ],
    extras_require={
        "fastai1": [
            "fastai==1.0.61",    # the last fastai v1
            "setuptools<81",     # fastai v1 imports pkg_resources, which setuptools 81 removed
            "spacy>=3,<4",       # fastai.text and fastai.distributed import spacy; fastai's metadata omits it on py>=3.8
            "ipywidgets",        # `from fastai.widgets import *` (ImageCleaner, lesson 2); fastai's metadata omits it
            "nbconvert",         # fastai.gen_doc (doc(), show_doc) imports it; fastai's metadata omits it
        ],
        "fastai2": ["fastai==2.8.12"],  # the fastai v2 ddipp.fastai2 is tested on
        "test": ["pytest", "nbclient", "ipykernel", "nbformat", "scikit-learn", "psutil"],
    },
)
