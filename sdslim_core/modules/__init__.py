"""nn.Module surgery: one layer factory, one child setter, runnable UNets, site swaps and the slim verb."""
