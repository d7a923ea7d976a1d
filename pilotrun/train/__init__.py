"""pilotrun.train"""
