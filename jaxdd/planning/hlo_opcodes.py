"""The classes of HLO opcodes that the traffic account (``compiled_traffic``) counts alike."""

# move nothing in device memory: names, tuples, views and the ends of async pairs
FREE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "add-dependency",
        "domain",
        "copy-done",
        "send-done",
        "recv-done",
        "async-done",
        "async-update",
        "all-reduce-done",
        "all-gather-done",
        "collective-permute-done",
        "get-dimension-size",
    }
)
# only move data: a fusion of these that reads a whole parameter copies it
MOVES = frozenset(
    {
        "copy",
        "concatenate",
        "transpose",
        "reshape",
        "bitcast",
        "slice",
        "pad",
        "parameter",
        "tuple",
        "constant",
    }
)
SLICING = frozenset({"dynamic-slice", "gather", "slice"})  # read what they output
UPDATING = frozenset({"dynamic-update-slice", "scatter"})  # in place: read and write their update
VIEWS = frozenset({"bitcast", "reshape"})  # inside a fusion: the same bytes, another shape
# inside a fusion, evaluated only where their output is needed
ELEMENTWISE = frozenset(
    {
        "convert",
        "negate",
        "abs",
        "exponential",
        "log",
        "tanh",
        "logistic",
        "sqrt",
        "rsqrt",
        "add",
        "subtract",
        "multiply",
        "divide",
        "maximum",
        "minimum",
        "select",
        "compare",
        "and",
        "or",
        "not",
        "xor",
        "copy",
        "clamp",
        "floor",
        "ceil",
        "round-nearest-even",
        "sign",
        "power",
        "exponential-minus-one",
        "log-plus-one",
        "is-finite",
    }
)
COLLECTIVES = frozenset(
    {
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
        "collective-broadcast",
    }
)
