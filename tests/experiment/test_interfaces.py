"""interfaces.py is the engines' contract: every engine keeps it, member for member, so
the contract a third engine is written against is the one the loop relies on."""

import inspect

import pytest

from experiment import config
from experiment import interfaces


def members(protocol):
    """A Protocol's own members: name -> the function or annotation that declares it."""
    declared = {name: value for name, value in vars(protocol).items()
                if not name.startswith("_")}
    declared.update(protocol.__annotations__)
    return declared


def parameters(function):
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize("engine", sorted(config.ENGINES))
def test_each_engine_module_keeps_the_contract(engine):
    module = config.ENGINES[engine].load()
    for name, declared in members(interfaces.EngineModule).items():
        assert hasattr(module, name), (engine, name)
        if inspect.isfunction(declared):
            assert parameters(getattr(module, name)) == parameters(declared)[1:], (engine, name)
    engine_class = module.Engine
    inspect.signature(engine_class).bind("config", "seed")  # built as Engine(config, seed)
    contract = members(interfaces.Engine)
    for name, declared in contract.items():
        assert parameters(getattr(engine_class, name)) == parameters(declared), (engine, name)
    public = {name for name in vars(engine_class) if not name.startswith("_")}
    assert public <= set(contract), (engine, public - set(contract))  # written down too
