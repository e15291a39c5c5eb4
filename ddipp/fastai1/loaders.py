"""fastai v1 loaders sharded across ranks (ddipp.core.sharding over fastai's samplers, SortishSampler, LM streams)."""
import sys

from fastai.basic_data import DeviceDataLoader
from fastai.core import defaults
from torch.utils.data import BatchSampler, Sampler, SequentialSampler

from ..core.dist import loader_workers
from ..core.sharding import RepeatedBatches, ShardedEvalBatchSampler, ShardedSampler, SplitBatchSampler


def text_if_imported():
    """ddipp's text loaders (`text_loaders`), or None while fastai.text is not imported: then no loader reads text, and
    a script that trains no text model does not pay for importing it (spacy, the text models)."""
    if "fastai.text.data" not in sys.modules:
        return None
    from . import text_loaders
    return text_loaders


def _language_model(dataset) -> bool:
    """True for fastai's language-model streams."""
    text = text_if_imported()
    return text is not None and isinstance(dataset, text.LanguageModelPreLoader)


def _train_sampler(sampler: Sampler, world_size: int) -> Sampler:
    """The order to shard: fastai's SortishSampler buckets over the global batch, so each rank's batch is alike."""
    text = text_if_imported()
    if text is not None and isinstance(sampler, text.SortishSampler):
        return text.GlobalSortishSampler(sampler.data_source, sampler.key, sampler.bs * world_size)
    return sampler


def shard_train_loader(loader: DeviceDataLoader, rank: int, world_size: int, seed: int) -> DeviceDataLoader:
    """A copy of `loader` that yields rank `rank`'s shard of its order, in batches of the same size.

    A language-model loader gets streams for the global batch (`ShardedLMStreams`), read in order."""
    batches, dataset = loader.dl.batch_sampler, loader.dl.dataset
    sampler = _train_sampler(batches.sampler, world_size)
    if _language_model(dataset):
        dataset = text_if_imported().ShardedLMStreams(dataset, batches.batch_size * world_size, seed)
        sampler = SequentialSampler(dataset)
    sampler = ShardedSampler(sampler, rank, world_size, seed)
    return _with(loader, dataset, BatchSampler(sampler, batches.batch_size, batches.drop_last))


def split_train_loader(loader: DeviceDataLoader, rank: int, world_size: int, seed: int) -> DeviceDataLoader:
    """A copy of `loader` whose batch k is rank `rank`'s part of the batch k one process reads (split_batches): items
    rank, rank+N, ... of it (`SplitBatchSampler`). A language model's loader reads `bs` streams, one row an item."""
    batches, dataset = loader.dl.batch_sampler, loader.dl.dataset
    if not isinstance(getattr(batches, "batch_size", None), int):
        raise TypeError(f"split_batches=True splits the training loader's batches of batch_size items, and its batch "
                        f"sampler ({type(batches).__name__}) has no batch_size: build the DataLoader with batch_size "
                        "(and a sampler) instead of a batch_sampler, or leave split_batches out")
    sampler = _train_sampler(batches.sampler, 1)
    if _language_model(dataset):
        dataset = text_if_imported().ShardedLMStreams(dataset, batches.batch_size, seed)
        sampler = SequentialSampler(dataset)
    parts = SplitBatchSampler(sampler, batches.batch_size, batches.drop_last, rank, world_size, seed)
    return _with(loader, dataset, parts)


def repeat_passes(loader: DeviceDataLoader, passes: int) -> DeviceDataLoader:
    """A copy of the sharded training `loader` whose every epoch reads its shard `passes` times (RepeatedBatches)."""
    return _with(loader, loader.dl.dataset, RepeatedBatches(loader.dl.batch_sampler, passes))


def shard_eval_loader(loader: DeviceDataLoader, rank: int, world_size: int) -> DeviceDataLoader:
    """A copy of `loader` whose batch k is rank `rank`'s part of the loader's batch k.

    A language-model loader's batch k is step k of all its streams (`lm_eval_loader`), whatever batch size the
    loader has: each rank keeps the same rows at every step."""
    loader = lm_eval_loader(loader)
    batches = ShardedEvalBatchSampler(list(loader.dl.batch_sampler), rank, world_size)
    return _with(loader, loader.dl.dataset, batches)


def lm_eval_loader(loader: DeviceDataLoader) -> DeviceDataLoader:
    """`loader`, or for a language model's loader whose batches are smaller than its streams, a copy whose batch k
    is step k of all the streams: the single-process loader with the global batch.

    fastai builds a launched process's preloader with bs·N streams but its loader with batches of bs, so a rank's
    rows would hop between streams from batch to batch (validate() and get_preds() outside a fit)."""
    dataset = loader.dl.dataset
    if not _language_model(dataset) or loader.dl.batch_sampler.batch_size == dataset.bs:
        return loader
    return _with(loader, dataset, BatchSampler(SequentialSampler(dataset), dataset.bs, drop_last=False))


def _with(loader: DeviceDataLoader, dataset, batch_sampler: Sampler) -> DeviceDataLoader:
    """A copy of `loader` reading `dataset` in the batches of `batch_sampler`, with this rank's share of the host's
    cores as worker processes if it had fastai's default (one per core)."""
    kwargs = dict(loader.dl.init_kwargs, batch_sampler=batch_sampler, batch_size=1, shuffle=False, sampler=None,
                  drop_last=False)
    kwargs["num_workers"] = loader_workers(kwargs.get("num_workers", 0), defaults.cpus)
    return DeviceDataLoader(loader.dl.__class__(dataset, **kwargs), loader.device, loader.tfms, loader.collate_fn)
