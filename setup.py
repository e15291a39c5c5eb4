from setuptools import setup, find_packages

setup(
    name="ddipp",
    version="0.1.0",
    description="Train a fastai v1 Learner with DistributedDataParallel on every GPU of a host, "
                "from a notebook or a script.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["ddipp", "ddipp.*"]),
    install_requires=[
        "fastai==1.0.61",        # the last fastai v1: the library ddipp exists for
        "torch==2.14.1",         # the torch this stack is tested on (ddipp.compat fixes fastai for it)
        "torchvision==0.29.1",   # the torchvision built for torch 2.14.1
        "setuptools<81",         # fastai v1 imports pkg_resources, which setuptools 81 removed
        "fastprogress==1.0.5",   # 1.1.x pulls a web-server stack and imports 10x slower; same bars for fastai v1
        "spacy>=3,<4",           # fastai.text and fastai.distributed import spacy; fastai's metadata omits it on py>=3.8
        "cloudpickle>=3",        # ships notebook-defined functions and classes to the workers
        "ipywidgets",            # `from fastai.widgets import *` (ImageCleaner, lesson 2); fastai's metadata omits it
        "nbconvert",             # fastai.gen_doc (doc(), show_doc) imports it; fastai's metadata omits it
    ],
    extras_require={
        "test": ["pytest", "nbclient", "ipykernel", "nbformat", "scikit-learn", "psutil"],
    },
)
