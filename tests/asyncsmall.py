"""The small async run the S3 and Ray tests compare with the same run on local disk (tests/conftest.py: local_async_run)."""


def small_async(weights, prompts, out, **settings):
    """The settings of the small async run the S3 and Ray tests compare with a local one (4 updates of 4 prompts, K 1)."""
    from opdcache.asyncopd import AsyncConfig, learner
    from opdcache.backends.base import SamplingConfig
    from opdcache.inputs.prompts import PromptConfig

    return AsyncConfig(learner=learner(weights / "student", steps=4, batch_size=4, lr=1e-4), teacher=weights / "teacher",
                       prompts=PromptConfig(prompts), out=out, staleness=1, sampling=SamplingConfig(temperature=1.0, max_new_tokens=8),
                       device="cpu", threads=1, **settings)
