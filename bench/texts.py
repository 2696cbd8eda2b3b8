"""Texts for the bench's text workload (``--model minilm``), shipped so every run sends the same
ones: 512 sentences of mixed length (80% of 4-14 words, 15% of 25-60, 5% of 120-200), made once with
``lab.minilm_bench.workload("mixed", n=512, seed=11)`` and frozen here (a change to that generator
does not move these figures)."""

TEXTS = (
    "Did because just get in after an first batch where with where.",
    (
        "Replica how came these an before our make queue said against it new while no world me before "
        "latency great come much deadline deadline are there into much old."
    ),
    "Batch because here will because might take came service.",
    "See said and by cluster.",
    "More an against still as there way system queue has those is but.",
    "Between even other network how work.",
    "And into one the queue at me old men against on did is.",
    (
        "Because to into model them into at another not did to to come of even such be state life "
        "deadline their batch that it each came three."
    ),
    "Might through all own from work and could.",
    "Very also up against throughput has more.",
    "First replica these latency did other latency.",
    "Queue being used was her with back first.",
    "Since about life up where.",
    "Men used know way batch made which your too but an make our made.",
    (
        "Had never years is with could state had where queue an an service more right could never that "
        "little came other little has one the did must by who those time who of is little they come your "
        "no little one can also state it some from are when than network do her."
    ),
    "By at server way own service first network first work year with both might.",
    "An same even us for new might those here.",
    (
        "Never make so as while some no the it is then its did well up back just still just is more last "
        "how its could model both two its are last too my men much back still day must any if about "
        "replica were from people can from much under in after one down."
    ),
    "Its little good system men never his about these state came other.",
    "May their which men right which.",
    "Work your they know their over memory way up that if.",
    (
        "Been long good might did also now used through her many right off these used from being people "
        "of man two such out against year it day people were my what through are did this are since "
        "before up go other not system of."
    ),
    "Me be replica such was here budget one years model this while.",
    "Against get take years are up about if.",
    (
        "Day get like how first through life me cluster come by network one been time great many never as"
        " under on no when off may same life men."
    ),
    "World was too man cluster right that server were time.",
    (
        "Model about any model being own time of which than down right at on make more us down server "
        "over over another this has system it came work service said each was still on these can were."
    ),
    "Here all can them.",
    "By over long service engine had no after if one when.",
    "Your only much not that each your do man be since is made then.",
    "Must each system must server other.",
    "Against made latency through because do should do well was with last against no.",
    "Even so here must like from time same make even had little.",
    "Get back new came.",
    "Know no and replica in might each the who were with because.",
    "Is other those way where.",
    "Still were into down get the then may them them come then just.",
    "These how never under.",
    (
        "Some never very can our of has are take batch being what throughput will old day request life be"
        " of and cluster their come any against see with like world before an never men with their own be"
        " for time no could here who own because first they its these year the said being in down no even"
        " to more us engine this three cluster good has very into other should an into throughput two too"
        " her here then just to were when be network many what more so more own where used old its can "
        "two off get over while how people both but very were his never was long has three is another "
        "server now replica are go three who men being down was own by may so new budget down other made "
        "get long last latency three since those then may these over batch make do while might which from"
        " like over for must each us should used over which between people made too has which only off "
        "great much so service cluster were see through came can."
    ),
    "Those out before server can who many me these queue three.",
    "Most cluster out batch if used memory if than his came.",
    "Replica good had day latency way same.",
    "Long but here your over each little be who another to they.",
    "Last network old out them great know deadline life system first.",
    "Where had was who two time and they this which day and can model.",
    "Too more man also being my might such may only back most.",
    "Did when used into before.",
    "Two only men can man year to.",
    "Your on been came.",
    "Between had engine by has server.",
    "Replica must men own because last had no which most to for about up.",
    (
        "Network come should through know his system all only against replica they over network one also "
        "back and each our men off world model was off state memory request each world way replica not "
        "before against us do it only three about like not right most them at how over since memory get "
        "are how right cluster them at been his people much me memory but see engine into years her some "
        "over both made while even their people which said take used great up own her day some not "
        "latency after one still what own batch some new were come could for such take they will "
        "throughput but they being as budget against engine work under be server request deadline people "
        "much were an how since long do little than in did latency is out and then out had each since "
        "under used engine."
    ),
    (
        "Latency as little budget both both because up by state that through never not there network "
        "while here me throughput of if way was our through as."
    ),
    "Into good new its long great had had our made those still throughput system.",
    "Throughput all state when there.",
    "Right been to when some.",
    "Way time than not first from man out too.",
    "Over right my here her.",
    "Service with still like while time.",
    "At its if right.",
    "It must own system may they what their them way little.",
    (
        "What replica in because long never year work has are good just made into this could only one is "
        "of too against good here about under never up the my take but if just out come such another all "
        "model new out such work into be last years model they day years never where by new man some only"
        " get his made service any was they memory what said since no cluster are these made came should "
        "right memory has life said throughput men many into state engine are time off both well long two"
        " has only came there can as they down for while man people little queue said so come well so in "
        "since all is engine out is one may over also some good do then since many down its just make "
        "then me us about did by being had server could those get like their out make server used day old"
        " last some when take like state used old no latency."
    ),
    "And has state two those as be still there between who in.",
    "Same that there little.",
    (
        "Good well what this cluster network make being also way work only man should since then for this"
        " at this year for get not who no before little because down be because from old that from all "
        "then come by all my who by."
    ),
    "Her our then under day most what go life out will.",
    "Most way as model over.",
    "Old then on too last since well where down an for me used its.",
    "From years is server while just deadline.",
    "Said make no down did before know too where much then other year state.",
    "Made know man very has were well under world men be never.",
    "It each engine by all who long.",
    "Server is well throughput being who but those.",
    "Each three some will them should most is should.",
    "See before so which from do if still can.",
    "My could than still his good each who they other must if.",
    "May one also could us latency in from man own this.",
    "While do at be world way latency the.",
    (
        "Last an these it years now through while replica go was even about how any like while know both "
        "what now our of way good the any has this memory too memory our with into that so very must just"
        " no can then their throughput never made people if long must that."
    ),
    (
        "Service still against system into never any own request such deadline which take both to little "
        "go cluster they them because right its has us throughput is queue very for over can such queue "
        "never cluster year world between are an of here no like throughput cluster might to such engine "
        "never with system no about at right."
    ),
    "Can my was that one.",
    "To to where at not request under through be how been server so in.",
    (
        "May under long life people own day where world new might but in go year any your good this with "
        "back could any his their some system both queue other years own before be very may too any see "
        "many this who did work when."
    ),
    (
        "Engine in budget after do new deadline well may by through both against my two throughput their "
        "and my my to after our year is never is were server into state life now now now out also model "
        "more come like could might much too model queue has people network at take said between been "
        "see."
    ),
    "Where into should engine their.",
    "Still little after another own.",
    "Might how here through at are.",
    "Those by two this made can since through deadline only came there.",
    "These never right now more well see be could should since can good both.",
    "Had under back some in life like since also this us.",
    "Man cluster down system.",
    "Off up to same that model should little through replica old world will.",
    "Budget been about deadline first used those more queue might were.",
    "My only first day if go even were down their.",
    "His little go against which your like may.",
    (
        "Not while for even network also so into which us may new new both some both since go its both "
        "are said has each memory long such more could memory another only latency these before now great"
        " service so did some are down came will the said first all great out many come us last deadline "
        "they make some made here this go more your where between last will some know off old here any "
        "while will under is get too through little those the own must in latency was in but it so on "
        "just like long may being came time with being there her latency latency and replica out off do "
        "system the little up budget just while people in those then good but people great is any very "
        "had should her has her now still will take came men what."
    ),
    "Last both never any against.",
    "My after most little your go each queue.",
    "Against same own and people all there throughput years no well before what request.",
    "After right work little replica to latency my were as it out up.",
    "Day who off must it.",
    "Can about see than same been me what state right.",
    (
        "Because this state get down another our network throughput my here one your most own these her "
        "do came might right very after own know very from it like that could do here since did good get "
        "while such how had know still queue network get is go down cluster about life it great like by "
        "must is."
    ),
    (
        "Will just into had are there little said in latency last there about his being how server in see"
        " which now great how queue against over get throughput if service of did used your how before."
    ),
    "First because here its.",
    (
        "More much an both into queue other come take an very new this must do then his some long them "
        "against two from old did had more used up now being very replica old what three where who than "
        "do that for just old one are."
    ),
    "Server an did each your been up day throughput up many.",
    "Came down the has against off so some can same was.",
    "Way get day other between day go our they.",
    "Between throughput cluster any in some on queue day must work my.",
    "No this engine know under be good too its make us under.",
    "Good server throughput from batch life then came server most my by so where.",
    "Is the latency of off state little great under since still queue.",
    "Memory up system many if should her about down.",
    "Another were memory model from.",
    "Some years how if after also.",
    "For last throughput get years might an then deadline same not.",
    "Made an if way two old made right these since.",
    "Under like up see will their.",
    "Off three with used too your much was.",
    "Engine take down are were not system very than had such should most still.",
    "While get now was service budget of when by each how never.",
    "Another network still new because for.",
    "Your after another only never many most then.",
    "And when go there at network.",
    "This our little old man be in year replica there throughput how out.",
    (
        "Man like still throughput very three both new our all an may might must our never our only never"
        " such see that budget then then system little such by those."
    ),
    "Being what replica over some.",
    (
        "Are such even may at system network last last same that server three life man into server "
        "service one in they system back now than other deadline most they do on go where."
    ),
    "In will take our my as not being that was made do.",
    "Against these request before up way right who but used get may no been.",
    "Back some made their come because now last.",
    (
        "Them down if just as their there before in but no against between made they model good here its "
        "up who work made system like cluster over how this they way make system us of his by after "
        "should been them man if when budget who into her request little people could in at so now as "
        "were years under network those on good in no in one said make had just cluster new another too "
        "latency them down only old was long was its here very any up also me who old do when no but take"
        " since their me way not and them used what long three all most such request should even them "
        "latency are request people way through know."
    ),
    "They in just how on people.",
    "Well day engine three new there so came could.",
    "Like me own since where about them of throughput.",
    "Way here are be see there years how memory being server make very.",
    "Old an for over might only here life another must.",
    "Men should network state against since on its world world.",
    "Then made it come for last system her.",
    "Men than cluster their as any at should men used people is us.",
    "Also these might too may great do request is like last.",
    "Two go very service against deadline came over new.",
    "Then long come last last might make her.",
    "Them well might had so long make up while way other the against.",
    "Network too see way each if where very.",
    "Because day two two which long your did on each request.",
    "What which over queue her but take system replica.",
    (
        "Well since latency year only good even most not man now and batch like make her where state "
        "years did little off those the man my before long his us our must still did when now said be "
        "might way it what their did great little this."
    ),
    "Server many my budget great under day well to because when latency.",
    "Against first where model back they both cluster out good years too last the.",
    "Old how do come as such are.",
    "My three great model that.",
    "First go do its through and back way there are last.",
    "Some network service not long.",
    "Cluster his down its other into will had with because more.",
    "New are budget little because into all that.",
    "By by men even only many and network.",
    "See state own other but.",
    "Over server had make to out queue had from.",
    (
        "Time under by queue service at make good first must off good long this my know here no life old "
        "not engine here too request their see just last no budget take last my even same way such day me"
        " little at with has that been said."
    ),
    (
        "When then them to old life be used what has if for for these being latency them with any can "
        "only to with when come was are last up was here all new at many."
    ),
    "Your time them just man here of then and them many.",
    (
        "Queue like might his through deadline state may still off both did budget network new also over "
        "they another one has see from both system state and make three batch server in."
    ),
    "Way up all said year.",
    (
        "Should day used like here deadline of well on replica over here batch for should last right off "
        "cluster used also how who is from came deadline now has their cluster been new there here great "
        "great as queue request because and work between that who were before its but has system batch "
        "one cluster even but those but man."
    ),
    "Up all model might be not and.",
    (
        "Take well see first most by memory year my when and all like year back great where no take two "
        "with world against too must two both are my years its both other if said men man never each it "
        "year network but then over this back day great said get old how also still."
    ),
    "Us world off between way.",
    "Such it so never all many its any great right new life such year.",
    "Years well and my budget latency since people.",
    (
        "Go should also engine and here has model this then life our it about state many them many made "
        "through never was about by not both up from throughput well much any up as an those with its "
        "only another people out man them us cluster queue but well also new from last last at little "
        "never day used also another like his used should only might replica any more come used had could"
        " through long your the while this any like out while get an they see these and even only while "
        "made now work way still own never still another service against me out well both to very all "
        "where no see been man must replica their might well life year down as model more."
    ),
    "For my an its down great do.",
    (
        "Well made never just new the two cluster against work people new server latency if take they "
        "little still came be up as to then request see very could each under against man said up much "
        "back memory just through which as because three not little cluster since back deadline there "
        "then was much has only them us well."
    ),
    "Get since our could too queue much after its so has memory do go.",
    "Most little network to like were know world then us world.",
    "Another if can budget two just on server all latency us will.",
    (
        "By your little some if now from which well engine been and know in me any so than of could men "
        "budget little your might much may through server those to people request man day both his to "
        "budget last at this under still more come men used off who this between can us three time made "
        "could which little at that be came her not could his another never man in his then some between "
        "made on over well state is own are being under years same in time same system know memory both "
        "years like could take too from deadline life throughput each here work own with cluster cluster "
        "even in since but from must state well time but well up two server much them and over men they "
        "been well who work another."
    ),
    "Do these people very which cluster could same which has take with.",
    "Back some said well while time if system be replica just.",
    "There his only first out long in last own.",
    "Those both too such back both was.",
    "Before where also go and at of very same how can very here.",
    "So being system world their.",
    "Did two get which them see good her when.",
    "To from were back that deadline his.",
    "Me said know who replica.",
    "Same last cluster her into how as batch me very where.",
    "Well since about queue had being other as even man were us about my.",
    "About be like world way could then before out then take they me.",
    "His budget do the made down through now could like off here.",
    "Do your are used way.",
    "Was each who time.",
    "Request from between people years great model only.",
    "An they day well back our it here not there off.",
    "Men great it by budget her if but some.",
    "Throughput even too man much where my as here that even.",
    "Which said old came with budget network first request off through engine had her.",
    "Back work other time and deadline.",
    "Only great still batch used being through little this time not.",
    "Day what budget is well see know which still great much.",
    (
        "There before which over than come may your memory man old because being also three very may "
        "queue deadline your network some were engine two might into three all must latency little then "
        "that came just each his that come like us."
    ),
    "See its still from one most off throughput his and can take.",
    "What an system one batch queue cluster right me.",
    "World they take long.",
    "Know any at to state come while.",
    "Very little network us not long but only its.",
    "Not back as us back of these.",
    (
        "Both way with may what most were before off too two as just while those much one said most "
        "server first do another another when about his where since all from said and only throughput an "
        "same never request over his new they should through who."
    ),
    "Way throughput people most now not being through came.",
    (
        "Your that service great latency any very both are such state one back replica work even so first"
        " budget latency new where queue no said me made might own through out came any for make used "
        "under which request long much even service network what after those many never that by not know "
        "man great over way over batch been work men time state us memory must even own also budget down "
        "men much another was great been there into is has as me even was service and over can batch long"
        " its some an long any most come throughput service take years us two throughput while man now "
        "which about batch never about by many another will memory well his system know well to for be "
        "this its the queue after on work man much our never but been replica long will will system man "
        "where."
    ),
    "Being throughput still can us had.",
    "Many at not man way her right because know latency those before back.",
    "Did back go being out.",
    "Your even years right old years for own there the under also.",
    "Been network about said well just as get get replica do much has replica.",
    "Could other way be its after here same years before service than well they.",
    "While of one between deadline much both and first request.",
    "Take memory were this right more.",
    "Between at memory if your many about at service.",
    "Engine between these most an.",
    "So both like right day go even by so now system.",
    "Just then old is world life more what memory no had while.",
    "Like should good who is.",
    "Which most no throughput no three by just is while own.",
    "Great go same those through each through memory server your never.",
    "Then your by right great come time.",
    "Make for came state little might engine their.",
    "It it come both both old model those up now.",
    "Great on because old cluster.",
    "Server an has long and for.",
    "Were most another old on and their they.",
    "While they too budget my these are now memory life never also.",
    (
        "Years than no world years little come will what never little work down after men are could like "
        "who network make my since what most state it request might latency through down own because his "
        "most know day these years take but no had the but them great between off here also since used."
    ),
    "Cluster as never when both for.",
    "Three this just was just one network system only through your.",
    (
        "Their new work good as your these such were now like than there has that like our her then were "
        "both through and long little both was server after little to over server this after being most "
        "me as did know for so never even."
    ),
    "While how may as that about deadline her if latency was but.",
    (
        "Where at men for had still through well any out too so latency day man to world more me time "
        "throughput another engine than by on off being request see these be then between see how request"
        " these these down me did those while but memory time."
    ),
    "Not time what each people if right.",
    "Between since model get which.",
    "Into so day they there.",
    "Back way us may any with as is each men our too service.",
    "Take other work many budget has about down not.",
    "Men model only many both replica which cluster latency that came own another.",
    "On take how me by very.",
    "All well now come its its made no day off an.",
    "Many if may for come might some by last as with in our never.",
    (
        "Under world so been these these any be which take throughput three when three model just memory "
        "out time man way world world now latency on said through."
    ),
    "Will service great much people down last service.",
    "Replica no do long my be both and by other deadline.",
    "Just up were is some.",
    (
        "His get two engine it know its model that still years know said last made this of them said "
        "people request them life right only on old be memory can now new cluster off us and out year "
        "back cluster can for other memory work make may are other year made this."
    ),
    "Will also may not an could two.",
    "Me about must how three what since way they.",
    "Last was network when then through batch might your been even her many.",
    "See of back while used.",
    "On great one from any each most about great.",
    "Not too about over.",
    "After long such state your if was well since.",
    "These never day good only budget.",
    "If against in any such see other people before.",
    "For used with each could could because budget but came but through who against.",
    "Those after her on used latency engine came well about with of.",
    "Not into two just do server.",
    (
        "Had then both they well down long take while who after many out two long still most than must if"
        " them engine most old see work this very same model each on model our engine how."
    ),
    "Queue much see new.",
    (
        "An down her server here these your request if many when another most said good most but your "
        "should before long batch is man deadline right throughput they than been into but service were "
        "many should state his there still after right an batch some on years no of our had and than "
        "still had man too such will one many with model take see each it new it used but this than do "
        "could as new last before used see up which great life memory come who after service service "
        "other them long good years be some then just since the queue did much did our little any day "
        "from used than might must right at two has her with good many was them memory long made through "
        "if are in them come into off replica are my same said at could men was back used state system it"
        " own while an know take come memory first which out come much deadline work is never is over men"
        " those may good between because only here under into another will cluster."
    ),
    "It cluster could them because very system.",
    (
        "That and such how own came if service through my world made take come service model against will"
        " between take an this last for last is server as was from might will us up being cluster has "
        "might will her state all from men them."
    ),
    "Great now off being being also last here and of.",
    "Were cluster because more should up came came take another.",
    "At that very take little model it to right the throughput but.",
    "Long first man came make great great who but how.",
    (
        "Another years state also both much all where back between another came model how off too not "
        "down my more and day all their in if men other up through how great had could on just another "
        "like may over if service deadline good her and their go while did even service which be between "
        "engine first very for how great did can service day off same through then two which then long "
        "made came but do will for make way same take network by one time into been were could too engine"
        " about latency them they with where same should model last it just after each know cluster came "
        "go some year that well day up long queue do right deadline latency here is well very because "
        "over by who engine before budget by had see same world down her do very because through."
    ),
    "And only do own work.",
    "Them up work may deadline time all know people.",
    (
        "What latency on after good your through just in many get is all they back last any under own "
        "than since their man well if since her on could very go when can if about our where had will "
        "being world from each also queue world batch year service much work are get us it latency "
        "throughput in batch server might how made each after then right had get just us take because to "
        "own your by little made request network and off these do be is than my network still but some "
        "could more old also under never request old be three as then when go also any own how this "
        "because too could when in service server your old it be off made also cluster same any where "
        "such take over what can cluster being and one two more one were budget in to never up work then "
        "at as server request both same three years against first more their world had which first some "
        "people old against but more but go into make many one do in good to will service day no in."
    ),
    "This said go throughput.",
    "Take great good other both who me because now must know.",
    "With no server being may new your batch do.",
    "Another one were had same while them memory well see made.",
    (
        "My but old same latency an down is great between take too who did over request system may never "
        "had since had just used two that know said new over should life been will first years over same "
        "they make his very take her deadline new had when time cluster still."
    ),
    "With are network may what to engine what must right should also years.",
    "So back too server our by since service up at all its.",
    "To who in another of up model here see very down its make.",
    "Model in great replica work out still may state used but.",
    "Get state could to first under men just might make if.",
    "Very very under me your under most is also so.",
    "Before such how know when while throughput.",
    "And long between many they there and with up.",
    "More under only another.",
    "Even last people than being.",
    "How be it them day is now most that long.",
    "When see can how old if more by only his.",
    "Service model was not made to will such some years me.",
    "Should another new come service after since old came might.",
    "It even are go at about another for may both it deadline.",
    "Made for after my time year since long right deadline.",
    "Service long may three after her being such me be had.",
    "Server network could could my budget into model.",
    "Has who then system cluster and men off made go new.",
    "Came good right should her.",
    "First from there my well.",
    (
        "Than two off one not memory if little time are where that will may said more of time batch said "
        "these server server us queue world them at might while now do other came those for here an my "
        "are much great too."
    ),
    "So into because on because service through not world us these most only other.",
    "As but this should.",
    "Used still about only off made came last year good said do get.",
    (
        "Good is how first even are was her her on his day into man our much by about not do it man take "
        "year who from budget but deadline not many even about most me own good budget made request me "
        "more must any years back time while people before before one year for one other did those last "
        "but such man deadline may engine engine not work between replica do must three also between "
        "replica more any most much world to into not service up get more into like men take latency been"
        " man for so way service time which for three never the latency two being off last down never "
        "after replica for it is right some work network memory been since get much may very last no "
        "after only up which his first engine year been other all used up their well good cluster will "
        "network little also know right used two day being."
    ),
    "Of its still many did.",
    "People make me they were.",
    (
        "These through made can life there should me an do into men about life deadline work much never "
        "through while cluster between since no her down them then no as your too server it which see "
        "that years in as and now network where it no."
    ),
    (
        "Memory while her replica here what such way off them latency her did your little see time so "
        "world how budget most only there in budget cluster also in much see here down from first is "
        "model request this from more."
    ),
    (
        "Of each out one not too now all life up memory made more before and good being old network three"
        " and too people these each not your from too go what out three queue when never throughput since"
        " memory world year many may me throughput had has like also must many as it."
    ),
    (
        "Were then made off at has what how year first own its time said good own not well make even take"
        " from and never about last if her at if server own see get people service those take still being"
        " up at there are as had one them their if last too them see may men life queue cluster were her "
        "know should said my may were work other the know to so still your like man that and two go "
        "another go had off what like like such if still be deadline in did world about its most well "
        "well your too then latency throughput down under old on most request man first network while up "
        "must about what where the they when had no must take state these replica what they our was that "
        "see where three us from people about made own memory state came came will make take throughput "
        "throughput its throughput being must because they then will here much since get down to get "
        "first any throughput."
    ),
    "Go how since each budget before her request take long will because just.",
    "On only service them an those it it back us this.",
    "Those only both replica our being between go up here life your.",
    "But another great request how so will.",
    "After go little what day into made that no some still old are.",
    "These up way each and made are request long made any way over.",
    "But can service long batch such little since from.",
    "Us me only also which them.",
    "Is then more its very batch what at after than well.",
    "They if there each against they about back each.",
    "Me get those their.",
    "Service right such man on year now between said so.",
    (
        "This day model still at well this on each good and then one what off way its more off budget "
        "even each are under being her if is more not the were it much throughput very might three came "
        "from still did two make just my make as two from as of me them."
    ),
    "Memory could too any his no world.",
    "Year get all cluster new under.",
    "Get an first year did one so me came.",
    "Who other much here people through as own year day.",
    (
        "Also how my an request up service many right in there were network so good three must must are "
        "many had after came life up state most our such engine may little now through."
    ),
    (
        "Life before cluster its years been now might own while each old his each was only to been each "
        "these could at because said not new your they us which time this year then an."
    ),
    (
        "Now her may each made the when world by too service before there what were even be was life very"
        " people another from at been queue is but was server both replica much now old come good way "
        "great said under see like could not which by same latency all had model came their people can "
        "much might those off too first them those this throughput now its those so of her state see "
        "another men like be come here who up how before then way between should not much go do never "
        "work first been me came own then and same the those with over when most life through than my "
        "such way such most model come but out long under these any this since replica year replica as "
        "never batch make us that very own all out off new because own who what state out this just work "
        "your all one into years to his these years those that very get my there what many from if could "
        "about know than model when request because at now be them these my your throughput for also at "
        "then old go queue between like world."
    ),
    "Then same came now here model most be there so about little.",
    "Come in old after while no used through little one were years can for.",
    "Good little off men.",
    "Out between batch all where might been deadline latency.",
    "Own its those this the come much should here make world.",
    "Most right between new system.",
    "Well too with his but at two.",
    "Some who came at about batch which so.",
    "Get first each too world.",
    "Them first good up should of in what.",
    "New might same latency was said long such.",
    "Queue two said out our like how request his work may her way.",
    "Old great here come was request request another two so memory being most world.",
    "Came very of has many one take through.",
    "Years her both all some so under budget used.",
    "One take also those on its only very no to.",
    "Through queue with only make come to should their latency life batch.",
    "No years and me more because down to.",
    "Latency last see to were model men all batch will off when state new.",
    "Out were been over first right for time more.",
    "Might us model used make queue.",
    (
        "Her system man they much down own well they way time by two must those replica these never than "
        "cluster were little make an into through there state server made may this up way from the must "
        "against other state should through than said even back be us that off model since both life now "
        "through their even make first just little how old replica latency some our batch engine like "
        "came replica engine cluster because my those did can three for three back from server many men "
        "his this since engine so all only very them server here very can make our must right back our "
        "way request well request men man must who must latency what your had could at that latency me "
        "how is over too will do take its men when us never too system last of where back did by year is "
        "her deadline and than my back has system man state many some service work our know me."
    ),
    "Just never how these never time day what more cluster like.",
    "Out its years be might.",
    (
        "My throughput both who so its much first be memory said so great day over state are used other "
        "said life batch only queue same do time latency men both if when take our about no about system."
    ),
    "Used may said to three for while world both time so our.",
    "Long new then deadline is engine because very can network came.",
    "One only your well back system service.",
    "Those great under take were should well also another even not their memory.",
    "Too before most back people over.",
    (
        "Had men but this model your should throughput people each most if such said some latency back "
        "their year another was network throughput state all other after well year server are other good "
        "off just very much own year those are another when her server both memory an be it world off his"
        " most model day throughput into men all."
    ),
    "Man your years old when off go go in.",
    "Been there man work after much than cluster model on replica first men.",
    "Very are with can where service under same queue come day out which.",
    "Before when memory how latency make while man and engine two these.",
    "There they being little great.",
    (
        "How three is made my three had than what latency in their men by no world way them service his "
        "will all up right if only with while way any much who each other service an down which those."
    ),
    (
        "Right queue through also just came time her did out made last back then will very just and what "
        "how than engine into his know who with back queue them had me people memory who replica see get "
        "against deadline like."
    ),
    "Deadline great because when time two who first since our.",
    "Came many that it first another who system take between know.",
    "Might server because each here three budget being memory take batch.",
    "Such each in what which no being server must last model if.",
    "Right before and being how.",
    "Now but server most good but budget each.",
    "Then by only used other this are said so good but.",
    (
        "Cluster throughput is request then while much may some between its one service can then queue "
        "take state may batch engine had an each must were only long of batch long like much and three "
        "only used at good man state might on deadline no what must which from."
    ),
    "Should if just been.",
    (
        "Up engine one model which cluster between for such said then by long under too network me how "
        "how in into our such had still down to many any other may at can our did since see their life as"
        " same of how day and than no and world any this little down years and against."
    ),
    "Long like his this they but your most very must day go was.",
    (
        "Batch will new do server engine it before know if how man replica old was came go they still "
        "before then two each by by our many its are life your and."
    ),
    "New only now did.",
    (
        "Even see then may from other were like model model service each little memory still there as "
        "must years here get old off her year first request right who people should it been now two did "
        "through the is now old most off service your must who through her as which is cluster me new too"
        " long has must well out from those said its must there into do our memory get service but here "
        "very system service just old made two may state still they did here new being was when out two "
        "network just my make but how off under came since was even between and years might any her "
        "network back see get which us one back latency little since service at same down up how model if"
        " own years about through said service our these many might come come man more get at only while "
        "even might can by then only."
    ),
    "No after was being engine of out any many same such.",
    (
        "Because if work people time into her at see know with about those both because same all might "
        "last up make might been more last world are of before know under that than here men little see "
        "that both should first long by us more deadline make more."
    ),
    "Time there make at all replica your made will made been with.",
    "Our another time make state since other most used of said queue.",
    "Old just their came before take up so very take by.",
    "Me no since all.",
    "Must budget work her where than take way network.",
    "Must my what last those by.",
    (
        "System our if batch will were used still my both do make should how much it us is world last "
        "long while such first before these against at came as those too because than about me made never"
        " their when after came that not if how."
    ),
    "Memory own know his then state some.",
    "No it on his man little should do against is these this.",
    "On another while three their these us too is long other.",
    (
        "Which here is many off with last any also most be good its years our its service these has has "
        "make of long us came replica still never two service our from most how because made back an his "
        "of."
    ),
    "Model how some than know over her queue may and as state.",
    "Memory work old state year service off server new than many.",
    (
        "Most used latency other great said after by through since must to so men some replica such when "
        "back world right been after latency your any long this last there cluster cluster life was each "
        "life here are this get life here has made used this right this too."
    ),
    (
        "For did as both also such their this to your engine what my their come never up service too "
        "before with who people come long way people how made against life your when men still."
    ),
    "With about two time under this had time another own could may also.",
    "Had it world model server.",
    "See used used that since little memory those her day.",
    "It was how did do engine take new take out still.",
    "Since one get to deadline by well by before take most work know were.",
    "Over where go because cluster off of new.",
    "Server on server my.",
    "Must but were no up his years made which people.",
    "There come time their your did batch old been make made are people out.",
    "Many deadline service work some our could time years up.",
    (
        "Come the were under about server me only must day come between people another had world it where"
        " good what how now life they same little new before our with also they of."
    ),
    "At their day same only can as.",
    (
        "And memory on year said man well service state network how good make work it here at where came "
        "used year go do under such long great."
    ),
    "As service because down now latency which when now.",
    "The world queue my old.",
    (
        "Day own be much here what no not after two us into all long too budget our go and what than "
        "about work each make since see into into what only made because same never man some and great "
        "see been take very."
    ),
    "Such said her through such also who by to up us.",
    "At deadline our here on through service of.",
    "Another these way before still new be very replica man before back.",
    "When little out know used been do that just now.",
    "Under could then time being network another into last world engine between me.",
    "Server just its was deadline long other what world replica.",
    "Men from its little when.",
    "Very being now said.",
    "Service men there should should had me latency network also too.",
    "If memory off the than no us.",
    "Much for queue by.",
    "Being long were had under our of the go it here.",
    "Budget can day not.",
    "Memory same on most they who right was has budget world.",
    "Is up people make being your there those me.",
    "Year years are over way people throughput me been just.",
    "Two go has go has did memory even server same that get.",
    "Throughput be many cluster.",
    "Do first what did be new.",
    "Cluster some budget over if each into because two what who.",
    "After said my but by they must most.",
    (
        "Should against from state but through in they three state here model state service well model "
        "how life made new those were me when they do get this last into where cluster against being "
        "between long much one system many too also world batch right world engine about should out "
        "throughput her this did and too years do another latency long under server much because do "
        "service very this men never life my than their first into will who it an into server out go what"
        " our made work may engine both model if also get first take work did such might replica by all "
        "out all at first also must two even made long who still is down never over latency of all know "
        "life our some who life own just back never how budget in what out used some there little last "
        "work one people there only such well been who us no is much new."
    ),
    "Might with replica used years year all said who.",
    "An then since me come who between they cluster time over.",
    (
        "Their can if no back well take are of first against off these then go on against had take these "
        "way might this how about our some who good man other with also people could years how back which"
        " is then get used men up used after queue another into men years even will as old came has "
        "request what while an day no take after right first most your then years man this are into all "
        "batch see year life at men these down their which with two man memory before memory no its what "
        "two by were this could now over throughput what has network time as each like many with same "
        "could us day were his came down memory well with well what did request people take out about out"
        " the another long but network old both system they well each what in like go before made work on"
        " latency state such very there in into so memory deadline been them if can in could those came "
        "most is old."
    ),
    "Very which see through man know its what and should do off of.",
    "Two where must while.",
    "Against under his them no some an when.",
    "Never server man many much might right.",
    (
        "Down for throughput three where up used at even through so at did system one out may over who "
        "not man made from each like with well than budget is queue first make could man network under "
        "replica request did men another all off those get did were server over world great cluster used "
        "for each work model."
    ),
    "Who come throughput queue because when.",
    (
        "Are her into back has her replica did her where might batch through might here back at much me "
        "to much those its of good by by me by their very at out at go also way how used system since how"
        " long back deadline are no."
    ),
    "Are some get first old after three deadline back.",
    (
        "May the some had both be request any by an many out over when is into they day old long "
        "throughput state well men more from replica other now this are."
    ),
    "Work deadline men make may his.",
    "Old just can than very between which.",
    (
        "About is an good after on what about could about come your cluster was if who your model between"
        " in man new said after your her memory its throughput how his only some your world throughput "
        "between from time still with to made then time here take engine people me my too with after "
        "request this of."
    ),
    "See right never if.",
    "Too before other old very this.",
    "Out may our state.",
    "Was deadline batch against back some three after.",
    "Could two his deadline between of being deadline now queue may under not then.",
    "To then some in is them such man own new to work three of.",
    "What then some they.",
    "Own replica because now such both each how two both world because three.",
    "Time most take to than under own.",
    "Any people go go.",
    "In for only its because in where deadline off so own one same should.",
    (
        "Right under right by their us so both at just work no could how make must is then being said be "
        "much budget take so will after way old which too for by with batch service both like under each "
        "before into had is very server than that off there can also world too years my which replica own"
        " this cluster server that did because first good can come all them well year so life for all "
        "system being at over is there the more at only memory life see which those state so great long "
        "must three network at here since before then service is much can which get has each old way "
        "against in do still could men there your since more deadline good latency still our might three "
        "this there each with three your should new cluster made on as all but come after time."
    ),
    "Model life down may been over engine what by.",
    "Memory should those queue take.",
    (
        "Queue old can model us request up but were them very so will might men after replica throughput "
        "right well on in very more even first but are replica way batch for man more if of for this "
        "server long about many batch engine those are by all throughput that her."
    ),
    "If such good no little not.",
    "For if old get well most many request even only your go budget may.",
    "These been used do as from off came.",
    "Same being day then are batch little there.",
    "Us are both one us.",
    "At this be time three.",
    (
        "World another most should their both good of through these new up come make for are men "
        "throughput own can good right do since system even our the queue this time may can life but most"
        " up latency back network cluster can most budget down through might as great is engine these "
        "should my will but those system back into even same way has one like with may also day at time "
        "where when still off before good good not much will since his last off go my here year same "
        "should queue last might never another even was if into then service back any queue off up know "
        "life under if know little more both are the new between engine came replica network some right "
        "this may like an as other budget used on still three many service the another as server much "
        "life right of those against could them the his been."
    ),
    "Its take years work.",
    "State me both to.",
    (
        "Know had they like too will go little before go under years be for that like will its day year "
        "up how come well with if made these."
    ),
    (
        "Then world because being where those both one this never even here your both are me it now their"
        " an its great model like take memory under said many made since some great those deadline "
        "service people when right may."
    ),
    "From they is used budget.",
    "Long system know been state might so your world their request.",
    "Three if go so same come men two engine request.",
    (
        "On at state long being this can these it should batch men through own cluster but model at "
        "service an system people queue but long request still own which about own too as as on just very"
        " one them little three what when."
    ),
    "Out when engine that like an as off more memory.",
    "At another each us other after not then.",
    (
        "Go back memory well they throughput under the our against take model deadline since world much "
        "with three much also down time is did with was by in other must know because three with each day"
        " memory which network has this most they another about after system system year never then."
    ),
    (
        "Was new here down very state between from work out the deadline being into more network much for"
        " it no deadline who also the did between too will might should batch from that well no also up "
        "most before while know some request get used."
    ),
    "Same about after those than were for the never those if long.",
    "Well even most off before for latency might was when were see by.",
    "Go where years by in made did memory they and at us into how.",
    "Three deadline only made year were which time some at up first know.",
    "Life cluster years two than at our go service but.",
    "An by get man.",
    "Under down any to good see more an your than replica much now.",
    "Right is years been replica their her then off.",
    (
        "People service model were right there take up budget because me off other many between is batch "
        "own out how out two will years me more were about over should just these can new great an were "
        "right can must very go was because can as world is too but get these under not since some made "
        "request way and here as right get about both these if its as all other if men its said such many"
        " her like has three budget people it new which do years be server last what all our they go can "
        "come make just through too of it should some life by both them there been as be these while been"
        " old engine those own all into after old service just request was in has new if an server go "
        "state first all against since do then when budget out much which of deadline first man still "
        "could like be make by from get and each from in little like when old great its while cluster be "
        "what that there world people work when take see some us in which never."
    ),
    "Memory my into most of for on who take up some.",
    "In both state is could too being.",
    "Who world those are do not still can no by about very not another.",
    "Us people people should get.",
    "Just like who has just how.",
    "His at own how not go some might same.",
    "Much into because between so system they man first one will world.",
    "Against do were request get of state well.",
    "Since were same under man time if not throughput being old before used then.",
    "On even first its.",
    "Can many not in engine day system.",
    "Well an budget memory did since day by is also now.",
)
