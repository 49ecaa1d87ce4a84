package relay

// NotesLock is notesLock, for the tests of package relay_test that hold
// the edits of a publication's comment back.
var NotesLock = notesLock

// HoldsRecorded reports whether r records its holds in the held table.
func HoldsRecorded(r *Relay) bool { return r.held.recorded }
