"""labkit: the helper package every LLM GPU Lab notebook imports.

Importing labkit (or any of its modules) has no side effects: it starts no threads,
initialises no CUDA context and spawns no processes. Work happens only when a function
is called.

Modules, with dependencies pointing one way (top depends on bottom):

    notebooks ─▶ launch, exercises, quiz, report
    workers   ─▶ dist, train, model, data, timing
    train     ─▶ model, timing        formulas, hardware, config: leaves
"""

__version__ = "0.1.0"
