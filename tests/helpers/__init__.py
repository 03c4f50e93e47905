"""The test suite's shared helpers: every module that more than one test module (or a test's worker script) uses.

Test modules import them as ``from helpers import zygote`` / ``from helpers.tiny_models import tiny_gpt2``: pytest
puts ``tests/`` on ``sys.path`` (tests/ has no ``__init__.py``), and the scripts under ``tests/scripts`` and
``tests/trainer_scripts`` that need a helper put it there themselves. No test module imports another
(tests/test_architecture.py checks it); what two test modules share lives here, in the module named for its job:

- ``zygote``: forks test processes from a preloaded interpreter (``Popen``, ``run``).
- ``distributed_launch``: gloo process groups and ``torchrun`` jobs, and the environment every test process gets.
- ``tiny_models``: tiny real transformers models and state comparisons.
- ``fakehub`` and ``hub_fixtures``: the local fake Hub server and its pytest fixtures.
- ``s3_fixtures``: a real SeaweedFS S3 server and its fixtures.
- ``engine_fixtures``: the CPU (gloo) FSDP / DeepSpeed shim the engine workers run under; ``engine_runs``: the
  engine tests' launches, references and comparisons.
- ``sharded_fixtures``: models, loop and references of the sharded-checkpoint tests and their workers.
- ``staging_probe``: holds a background save's copy until the next optimizer step has begun.
- ``trainer_runs``: ``tests/trainer_scripts/train_tiny.py`` run as a process (killed, resumed, under torchrun) and
  the bit-for-bit comparison of its outputs; ``trainers``: ``ResumableTrainer`` built in-process on tiny models.
- ``accelerate_runs``: ``examples/custom_loop.py`` runs and the in-process accelerate set-up.
- ``elastic_runs``: the elastic workers' launches at any world size and their comparison.
- ``streaming_models``: the models and checks of the lazy-streaming tests.
"""
