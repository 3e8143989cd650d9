"""models.mamba1"""
