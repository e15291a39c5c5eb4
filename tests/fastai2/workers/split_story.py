"""split_batches on fastai v2: the story (fit_story.py) and what else counts steps or samples, with the training
loader's batch kept as the global batch; played in one process (the reference), launched and in notebook mode."""
from fastai.callback.tracker import EarlyStoppingCallback
from fastai.callback.training import GradientAccumulation

from fit_story import StepLosses, digits_dls, digits_learner, history, params, story

# (batch size, drop_last): 645 training items; 16 splits evenly over 2 ranks and leaves a last batch of 5, 15 splits
# evenly over 3 ranks
SETTINGS = [(16, False), (15, True)]


def split_story(make, path) -> dict:
    """The fit story, then a fit with GradientAccumulation and one that EarlyStoppingCallback stops, each on a new
    learner from `make(learner)` (to_ddp, or nothing for the reference)."""
    res = {}
    for bs, drop_last in SETTINGS:
        def learner():
            return make(digits_learner(digits_dls(bs=bs, drop_last=drop_last), path))
        key = f"bs{bs}"
        res[key] = story(learner())
        learn, steps = learner(), StepLosses()
        learn.fit(2, 1e-2, cbs=[GradientAccumulation(n_acc=40), steps])
        res[key]["accumulated"] = dict(params=params(learn), history=history(learn), steps=len(steps.losses))
        learn = learner()
        stop = EarlyStoppingCallback(monitor="valid_loss", min_delta=0.05, patience=1)  # after 4 epochs of 12
        learn.fit(12, 1e-2, cbs=stop)
        res[key]["early_stop"] = dict(params=params(learn), history=history(learn))
    return res
