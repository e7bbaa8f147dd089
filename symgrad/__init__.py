"""symgrad: from the elementwise formula of a tensor op to its TensorFlow gradient module.

The pipeline, one module per stage: spec -> parse -> model -> derive -> lower -> render
-> emit; `cli` wires them to the command line. Generation never imports TensorFlow.
"""

__version__ = "0.1.0"
