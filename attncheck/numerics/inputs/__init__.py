"""What goes into a diagnosis: Q, K and a mask -> scores per dtype as models compute them, and
the facts of a call's heads."""
