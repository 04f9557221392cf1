"""The plugin registry: the reducer table and its MRO lookup (``reducer_table``), safe globals and module claims
with their trust rules (``declarations``), plugins from entry points (``discovery``), one plugin's registration as
a transaction (``registrar``), what a load does with the plugins its header names (``preparation``), and the
``Registry`` that composes them (``registry``).

Layers inside (lowest first): ``reducer_table`` < ``declarations`` < ``discovery`` < ``preparation`` |
``registrar`` < ``registry``.
"""
