"""pilotrun.report"""
