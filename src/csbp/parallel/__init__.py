"""Process groups, counted collectives and the local multi-process launcher."""
