"""Adapters to the training frameworks users already run (Lightning, torchtitan, ...).

Group: each framework has its own module here, imported only when used: importing
this package imports no framework (and none of its modules), so the extras stay
optional. The library shards; the framework trains.
"""
