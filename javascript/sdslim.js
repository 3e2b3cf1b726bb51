// SD Slim tab: the Train click gets a task id, so the webui's progress bar and its status text follow the run
// (requestProgress and randomId are the webui's own, in its javascript/progressbar.js).
function sdslim_start_training() {
    var id = randomId();
    requestProgress(id, gradioApp().getElementById('sdslim_train_output'), null, function() {}, function(progress) {
        gradioApp().getElementById('sdslim_train_progress').innerHTML = progress.textinfo || '';
    });
    var args = Array.from(arguments);
    args[0] = id;
    return args;
}
