"""What a restricted load admits: the opcode-by-opcode bounds check of a stream (``streamcheck``), what it does to
which value, worked out before it runs (``semantics``; its engine in ``handlers``), the built-in safe set of
validating rebuilds (``safe_set``; its tensor rebuilds in ``safe_tensors``, ``safe_composite`` and
``safe_parameters``), and the allow-lists, the blocklist, admission and refusal messages (``restricted``).

Layers inside (lowest first): ``safe_tensors`` | ``streamcheck`` | ``tags`` < ``handlers`` | ``safe_composite`` <
``safe_parameters`` < ``blocklist`` | ``entries`` | ``safe_set`` | ``semantics`` < ``advice`` < ``restricted``.
"""
