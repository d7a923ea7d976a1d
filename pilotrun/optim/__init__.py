"""pilotrun.optim"""
