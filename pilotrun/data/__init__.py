"""pilotrun.data"""
