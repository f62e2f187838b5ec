"""What a run can pick by name: accumulation strategies, engines, models.

Why a module of its own: main.py parses and validates every flag before it imports
TensorFlow (so `--help` and a bad flag are answered at once), and the flags' choices are
these names, while the implementations (strategies.py, trainer.py, engine_*.py,
model.py) import TensorFlow. So each choice is named here once, with its one line of
help and where its implementation lives (`module:attribute`), and the implementation is
imported only when a run uses it (`Choice.load`), as loop.py loads an engine. Nothing
here imports TensorFlow (tests/test_cli.py checks it in a fresh process).

Adding a strategy: one entry in STRATEGIES, its class in strategies.py (docs/extending.md).
"""

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Choice:
    """One name a flag accepts: a line of help, and what it loads (`module` or
    `module:attribute`; None where each engine has its own implementation)."""
    help: str
    target: str = None

    def load(self):
        """The implementation: the module, or its attribute (imports TensorFlow)."""
        module, _, attribute = self.target.partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, attribute) if attribute else loaded


# --accumulate: where the window of N mini-batches lives (tf1 engine). Each class
# implements interfaces.Averager.
STRATEGIES = {
    "stack": Choice("the post's numpy stack of N gradient lists", "trainer:GradientAverager"),
    "running": Choice("a numpy running sum", "strategies:RunningSumAverager"),
    "graph": Choice("accumulator variables, applied by a run of their own",
                    "strategies:GraphAverager"),
    "fused": Choice("one session call per update", "strategies:FusedAverager"),
    "optimizer": Choice("trainer.AveragingOptimizer's train op, one run per mini-batch",
                        "strategies:OptimizerAverager"),
}

# --engine: the module (interfaces.EngineModule) that trains a run.
ENGINES = {
    "tf1": Choice("the post's graph and session loop", "engine_tf1"),
    "tf2": Choice("a Keras model trained one tf.function call per window (engine_tf2.py)",
                  "engine_tf2"),
}

# --model: each engine builds it its own way (model.MODELS, engine_tf2.MODELS, same keys).
MODELS = {
    "convnet": Choice("the post's LeNet-like network"),
    "mlp": Choice("a 784-4096-4096-10 dense network"),
}


def described(choices):
    """'a (its help), b (its help)': the choices for a flag's help text."""
    return ", ".join(f"{name} ({choice.help})" for name, choice in choices.items())
