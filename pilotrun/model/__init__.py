"""pilotrun.model"""
