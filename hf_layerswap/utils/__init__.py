"""Infrastructure that every stage shares and that knows no stage: files written all or
nothing (:mod:`.jsonio`), where a module computes (:mod:`.devices`), the versions and
identities behind the numbers (:mod:`.provenance`), optional dependencies (:mod:`.extras`)
and the live lists of a registry's names (:mod:`.registry_names`). Nothing here imports
another module of the package outside this folder (tests/test_structure.py).
"""
